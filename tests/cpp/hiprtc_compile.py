"""Compile one translation unit with hiprtc (through ctypes), as a separate process: Debian's ROCm
5.2 hiprtc aborts the process for targets it does not know, so the tests never load it in-process.

    python hiprtc_compile.py SOURCE OUTPUT OPTION...

Needs a libhiprtc.so on LD_LIBRARY_PATH (on Debian, a link to libamdhip64.so.5, which holds hiprtc).
Exit status 0 with the code object written, else 1 with hiprtc's log on stderr.
"""

from __future__ import annotations

import ctypes
import sys


def main(source: str, output: str, options: list[str]) -> int:
    rtc = ctypes.CDLL("libhiprtc.so")
    prog = ctypes.c_void_p()
    text = open(source, "rb").read()
    if rtc.hiprtcCreateProgram(ctypes.byref(prog), text, source.encode(), 0, None, None) != 0:
        print("hiprtcCreateProgram failed", file=sys.stderr)
        return 1
    opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
    status = rtc.hiprtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    if status != 0:
        rtc.hiprtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        rtc.hiprtcGetProgramLog(prog, log)
        print(f"hiprtcCompileProgram returned {status}:\n{log.value.decode(errors='replace')}", file=sys.stderr)
        return 1
    rtc.hiprtcGetCodeSize(prog, ctypes.byref(size))
    code = ctypes.create_string_buffer(size.value)
    rtc.hiprtcGetCode(prog, code)
    with open(output, "wb") as f:
        f.write(code.raw)
    rtc.hiprtcDestroyProgram(ctypes.byref(prog))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
