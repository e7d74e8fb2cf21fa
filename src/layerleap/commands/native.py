"""``layerleap native``: the C++ decoder layers (``layerleap.core.native``): status, or build them."""

from __future__ import annotations

import json
import time

from . import command
from ..errors import LayerleapError


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
            native.build()
        except Exception as e:  # a compiler or ninja missing, or a failed build: the Python path stays
            raise LayerleapError(
                f"the native layers could not be built ({type(e).__name__}: {str(e)[:300]}); "
                "layerleap keeps running its Python path"
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
            else "built, not loaded"
            if st["built"]
            else "not built: run `layerleap native --build`"
        )
        target = "" if st["march"] == "native" else f", -march={st['march']} ({native.MARCH_ENV})"
        print(f"native decoder layers: {state}" + (f" ({st['library']}{target})" if st["library"] else target))
    return 0
