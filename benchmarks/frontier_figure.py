"""Draw some curves of an `layerleap eval frontier` report (e.g. BiLD's ablation apart from CALM).

python benchmarks/frontier_figure.py REPORT.json OUT.png bild,bild-no-rollback,bild-no-fallback
"""

from __future__ import annotations

import json
import sys

from layerleap.commands.skipdecode import _frontier_figure
from layerleap.files import save_figure


def main(report: str, out: str, groups: str) -> None:
    with open(report) as f:
        data = json.load(f)
    save_figure(_frontier_figure(data, groups.split(",")), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
