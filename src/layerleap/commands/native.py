"""``layerleap native``: the C++ decoder layers (``layerleap.core.native``): status, or build them."""

from __future__ import annotations

import json
import re
import time

from . import command
from ..errors import LayerleapError


def _reason(e: Exception) -> str:
    """Why a build failed, in one line: the first error line of the compiler's output where the message
    holds it (the command lines before it run to hundreds of characters), else the message's first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if re.search(r"\berror\b|not found|no such file|cannot find", line, re.IGNORECASE)
        and not line.startswith("Error building extension")
    ]
    text = (errors[0] if errors else lines[0] if lines else "")[:300]
    return text if isinstance(e, LayerleapError) else f"{type(e).__name__}: {text}"


@command("native", help="the C++ decoder layers: show whether they are built, or build them (--build)")
def _setup(p):
    p.add_argument(
        "--build",
        action="store_true",
        help="compile them now if needed (~30 s, once per torch "
        "version, CPU and source; needs a C++ compiler and ninja)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


@_setup
def run(args) -> int:
    from ..core import native

    if args.build:
        t = time.perf_counter()
        try:
            native.build()  # with the ninja beside this Python on PATH (native.ninja_on_path)
        except Exception as e:  # a compiler or ninja missing, or a failed build: the Python path stays
            raise LayerleapError(
                f"the native layers could not be built ({_reason(e)}); layerleap keeps running its Python path"
            ) from None
        if not args.json:
            print(f"built in {time.perf_counter() - t:.1f} s")
    st = native.status()
    if args.json:
        print(json.dumps(st))
    else:
        state = (
            "in use"
            if st["in_use"]
            else "disabled (LAYERLEAP_NATIVE=0)"
            if st["disabled"]
            else "built, not loaded" + (f": {st['error']}" if st["error"] else "")
            if st["built"]
            else "not built: run `layerleap native --build`"
        )
        target = "" if st["march"] == "native" else f", -march={st['march']} ({native.MARCH_ENV})"
        print(f"native decoder layers: {state}" + (f" ({st['library']}{target})" if st["library"] else target))
    return 0
