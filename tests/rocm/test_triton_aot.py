"""Every Triton kernel the ROCm plugin launches compiles for gfx90a and gfx942 with the plugin's own
launch tables, with no GPU: the plugin's kernel functions run on meta tensors with tables pinned to
the architecture, Triton's JIT specialises each launch as it would on the device, and the launch is
compiled (hal_backend_rocm.aot). Checked: ``asm["hsaco"]`` is an ELF whose notes name the target
and a wavefront of 64, matrix kernels use MFMA instructions, LDS fits the 64 KiB of a workgroup, and
the AMD launch options reach Triton's HIP backend under names it knows and change the code.

Compilation is the slow part (about a second a kernel, more for GEMMs): both architectures compile
in two worker processes, once per session, one launch per entry kernel plus every GEMM launch.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
import shutil
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

from hal_backend_rocm import TRITON_KERNELS, aot  # noqa: E402
from hal_backend_rocm._device import ARCHS  # noqa: E402
from hal_backend_rocm.launch import GEMM_CANDIDATES, INT8_CANDIDATES, WGRAD_CANDIDATES  # noqa: E402
from hal_triton import aot as kit_aot  # noqa: E402

MATRIX_KERNELS = ("gemm.gemm_kernel", "grouped_gemm.gg_forward_kernel", "grouped_gemm.gg_weight_grad_kernel")
#: the option changes whose effect is checked on the default bf16 GEMM, split between the two
#: architectures' workers (kpack=2 is what the gfx942 tables set)
OPTION_CHANGES = {"gfx90a": {"matrix_instr_nonkdim": 32, "waves_per_eu": 0}, "gfx942": {"kpack": 1, "num_stages": 1}}


def selection(launches: list[aot.Launch]) -> list[aot.Launch]:
    """Every distinct launch of a matrix kernel, and the first launch of every other kernel."""
    seen: set[str] = set()
    out = []
    for launch in aot.distinct(launches):
        if launch.name in MATRIX_KERNELS or launch.name not in seen:
            out.append(launch)
            seen.add(launch.name)
    return out


def _summary(launch: aot.Launch, compiled: Any) -> dict[str, Any]:
    amdgcn = compiled.asm["amdgcn"]
    return {
        "name": launch.name,
        "constants": {k: v for k, v in launch.constants.items() if isinstance(v, (int, bool, str))},
        "options": launch.options,
        "shared": int(compiled.metadata.shared),
        "hsaco": bytes(compiled.asm["hsaco"]),
        "mfma": sorted({line.split()[0] for line in amdgcn.splitlines() if line.strip().startswith("v_mfma")}),
        "amdgcn": amdgcn,
        "ttgir": compiled.asm["ttgir"],
        "waves_attr": re.findall(r'"amdgpu-waves-per-eu"="([^"]*)"', compiled.asm["llir"]),
    }


def compile_arch(arch: str) -> dict[str, Any]:
    """(in a worker process) the compiled selection for ``arch``, and the default bf16 GEMM with
    each of its OPTION_CHANGES."""
    launches = aot.capture(arch)
    out: dict[str, Any] = {"captured": sorted({launch.name for launch in launches}), "kernels": [], "variants": {}}
    for launch in selection(launches):
        out["kernels"].append(_summary(launch, launch.compile(arch)))
        if launch.name == "gemm.gemm_kernel" and launch.constants.get("MMA") == 0 and "default" not in out["variants"]:
            base, out["variants"]["default"] = launch, out["kernels"][-1]
    for name, value in OPTION_CHANGES[arch].items():
        variant = dataclasses.replace(base, options={**base.options, name: value})
        out["variants"][name] = _summary(variant, variant.compile(arch))
    return out


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, Any]]:
    with ProcessPoolExecutor(max_workers=len(ARCHS), mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(ARCHS, pool.map(compile_arch, ARCHS)))


def test_every_kernel_of_the_plugin_has_representative_calls() -> None:
    calls = aot.representative_calls()
    assert {op for op, _ in TRITON_KERNELS} <= set(calls)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_calls_reach_every_entry_kernel_of_the_kit(compiled: dict, arch: str) -> None:
    kit = {f"{family}.{name}" for family, name in kit_aot.kernel_names()}
    assert kit - set(compiled[arch]["captured"]) == set(), "hal_triton kernels no representative call launches"


def _notes(hsaco: bytes, tmp_path: Path) -> str:
    readelf = shutil.which("llvm-readelf-15") or shutil.which("llvm-readelf")
    if readelf is None:
        pytest.skip("llvm-readelf is not installed (scripts/install_hip.sh installs it with hipcc)")
    path = tmp_path / "kernel.hsaco"
    path.write_bytes(hsaco)
    return subprocess.run([readelf, "--notes", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("arch", ARCHS)
def test_code_objects_are_elves_for_the_architecture(compiled: dict, arch: str, tmp_path: Path) -> None:
    kernels = compiled[arch]["kernels"]
    assert len(kernels) >= len(kit_aot.kernel_names())
    for k in kernels:
        assert k["hsaco"][:4] == b"\x7fELF", k["name"]
        notes = _notes(k["hsaco"], tmp_path)
        # the triple is amdgcn-amd-amdhsa--gfx90a from LLVM 15, amdgpu9.0a-amd-amdhsa-unknown-gfx90a from Triton's LLVM
        assert re.search(rf"amdhsa\.target:\s+'?[a-z0-9.]+-amd-amdhsa-[a-z]*-{arch}'?\n", notes), (k["name"], notes[-300:])
        assert ".wavefront_size: 64" in notes, k["name"]


@pytest.mark.parametrize("arch", ARCHS)
def test_matrix_kernels_use_mfma_and_fit_lds(compiled: dict, arch: str) -> None:
    lds = ARCHS[arch].lds_bytes
    for k in compiled[arch]["kernels"]:
        assert k["shared"] <= lds, f"{k['name']} allocates {k['shared']} bytes of LDS, more than {lds}"
        if k["name"] in MATRIX_KERNELS and k["constants"].get("MMA") != 2:  # MMA 2: the float64 FMA path
            assert k["mfma"], f"{k['name']} {k['constants']}: no v_mfma instruction for {arch}"
            assert k["options"]["matrix_instr_nonkdim"] in (16, 32)
            size = k["options"]["matrix_instr_nonkdim"]
            assert all(f"_{size}x{size}x" in m for m in k["mfma"]), (k["name"], k["mfma"])
    assert any(m.startswith("v_mfma_i32") for k in compiled[arch]["kernels"] for m in k["mfma"]), "no int8 MFMA"


def _candidates() -> list:
    return [c for table in (GEMM_CANDIDATES, WGRAD_CANDIDATES, INT8_CANDIDATES) for cands in table.values() for c in cands]


def test_option_names_are_hip_backend_options() -> None:
    """Triton drops option names it does not know: every name the tables use must be a field of
    the installed Triton's HIPOptions."""
    from triton.backends.amd.compiler import HIPOptions

    fields = {f.name for f in dataclasses.fields(HIPOptions)}
    used = {name for c in _candidates() for name, _ in c.options}
    assert used == {"waves_per_eu", "matrix_instr_nonkdim", "kpack"}
    assert used | {"num_warps", "num_stages"} <= fields


@pytest.mark.parametrize("arch", ARCHS)
def test_launch_options_reach_triton_as_the_tables_say(compiled: dict, arch: str) -> None:
    """What Triton's HIP backend parsed for each GEMM launch is the table's configuration (names it
    dropped would be missing or back at their defaults)."""
    configs = {c for table in (GEMM_CANDIDATES, WGRAD_CANDIDATES, INT8_CANDIDATES) for c in table[arch]}
    matrix = [k for k in compiled[arch]["kernels"] if k["name"] in MATRIX_KERNELS and k["constants"].get("MMA") != 2]
    assert matrix
    for k in matrix:
        options = k["options"]
        assert any(options["num_warps"] == c.num_warps and options["num_stages"] == c.num_stages
                   and all(options[n] == v for n, v in c.options) for c in configs), (k["name"], options)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_option_changes_the_compiled_code(compiled: dict, arch: str) -> None:
    variants = compiled[arch]["variants"]
    default = variants["default"]
    assert default["options"]["matrix_instr_nonkdim"] == 16 and default["waves_attr"] == ["2,2"]
    bf16 = {"gfx90a": "bf16_1k", "gfx942": "_bf16"}[arch]  # v_mfma_f32_16x16x16bf16_1k, v_mfma_f32_16x16x16_bf16
    assert len(default["mfma"]) == 1 and default["mfma"][0].startswith("v_mfma_f32_16x16x16") and default["mfma"][0].endswith(bf16)
    for name, value in OPTION_CHANGES[arch].items():
        assert variants[name]["amdgcn"] != default["amdgcn"], f"{name}={value} left the code unchanged"
    if arch == "gfx90a":
        assert variants["matrix_instr_nonkdim"]["mfma"] == ["v_mfma_f32_32x32x8bf16_1k"]
        assert variants["waves_per_eu"]["waves_attr"] == []
    else:
        assert variants["kpack"]["ttgir"] != default["ttgir"]  # kpack shapes the MFMA operand layout
        assert variants["num_stages"]["ttgir"] != default["ttgir"]  # the software pipeline


#: the FP8 kernels of the plugin with gfx942's instructions: packed conversions to e4m3fnuz (fp8)
#: in the casts, and the FP8 MFMA (e5m2fnuz x e4m3fnuz: bf8 and fp8 operands) in the GEMM
FP8_INSTRUCTIONS = {
    "fp8.fp8_encode_kernel": r"v_cvt_pk_fp8_f32",
    "fp8.fp8_rows_kernel": r"v_cvt_pk_fp8_f32",
    "fp8.fp8_blocks_kernel": r"v_cvt_pk_fp8_f32",
    "fp8.fp8_gemm_kernel": r"v_mfma_f32_\w+_(bf8_fp8|fp8_bf8)\b",
}


def test_fp8_kernels_use_gfx942_fp8_instructions(compiled: dict) -> None:
    kernels = {k["name"]: k for k in compiled["gfx942"]["kernels"]}
    for name, pattern in FP8_INSTRUCTIONS.items():
        assert name in kernels, f"{name} was not captured for gfx942"
        assert re.search(pattern, kernels[name]["amdgcn"]), f"{name}: no {pattern} in the gfx942 code"
