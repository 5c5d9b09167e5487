"""``python -m hal.cli.docs`` where hal is installed, not a checkout: docs/ops.md belongs to a source
checkout, so it says so and exits 2 (it looked for site-packages/docs/ops.md), unless --out names
the file. scripts/check_install.sh runs it in a real installed environment too."""

from __future__ import annotations

from pathlib import Path

import pytest

from hal.cli import docs

ROOT = Path(__file__).resolve().parents[2]


def test_checkout_root_tells_a_checkout_from_an_installed_package(tmp_path: Path) -> None:
    assert docs.checkout_root() == ROOT and docs.DEFAULT_PATH == ROOT / "docs" / "ops.md"
    installed = tmp_path / "lib" / "python3.11" / "site-packages" / "hal" / "cli" / "docs.py"
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    assert docs.checkout_root(installed) is None
    (tmp_path / "lib" / "python3.11" / "site-packages" / "docs").mkdir()  # some other package's docs/ beside hal
    assert docs.checkout_root(installed) is None


@pytest.mark.parametrize("check", [True, False], ids=["check", "write"])
def test_without_a_checkout_it_exits_2_and_says_what_to_do(check: bool, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(docs, "DEFAULT_PATH", None)  # as in an installed hal (checkout_root() is None there)
    assert docs.main(["--check"] if check else []) == 2
    err = capsys.readouterr().err
    assert "not from a source checkout" in err and f"no docs/ops.md to {'check' if check else 'write'}" in err
    assert "--out PATH" in err


def test_out_names_the_file_anywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(docs, "DEFAULT_PATH", None)
    target = tmp_path / "ops.md"
    assert docs.main(["--out", str(target)]) == 0 and target.read_text() == docs.render()
    assert docs.main(["--check", "--out", str(target)]) == 0
    target.write_text(target.read_text() + "edited by hand\n")
    assert docs.main(["--check", "--out", str(target)]) == 1
