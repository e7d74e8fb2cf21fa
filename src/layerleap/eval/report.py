"""A benchmark as one self-contained HTML page (``layerleap bench --html report.html``).

``html_report(bench_dict)`` renders the JSON report of ``bench.run_bench`` (``BenchResult.to_dict()``):
the command, the machine, threads and dtype; the summary table; tokens/s by method and category
beside greedy and `transformers`; speed-ups; drafting acceptance and tokens per model call; layers per
token; and the call-cost curve (the time of one model call by the number of new tokens it takes)
when the report holds one under ``"call_cost"``.  The charts are inline SVG drawn here; the page
loads nothing from anywhere.
"""

from __future__ import annotations

from html import escape

from .bench import HF_LABEL, REFERENCE, failure_lines

PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#1f77b4",
    "#8c564b",
]
WIDTH = 880
LABEL_W = 170
CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 940px;
       color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
code, pre { font-family: Menlo, Consolas, monospace; font-size: 12.5px; background: #f5f5f5; padding: 2px 4px; }
pre { padding: 8px; white-space: pre-wrap; word-break: break-all; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: right; }
th:first-child, td:first-child { text-align: left; }
table.facts td { text-align: left; } table.facts td:first-child { color: #666; }
p.note { color: #666; font-size: 13px; } svg { display: block; margin: 8px 0; }
svg text { font-family: Helvetica, Arial, sans-serif; }
"""


# -- formatting ----------------------------------------------------------------------------------------
def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def _nice_max(v: float) -> float:
    """A round axis end at or above ``v``."""
    if v <= 0:
        return 1.0
    import math

    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * exp >= v:
            return m * exp
    return 10 * exp


def _ticks(top: float, n: int = 5) -> list[float]:
    return [top * i / n for i in range(n + 1)]


# -- charts --------------------------------------------------------------------------------------------
def hbar_chart(
    title: str,
    rows: list[str],
    series: list[tuple[str, list[float | None]]],
    fmt: str = ".1f",
    unit: str = "",
    ref: float | None = None,
    ref_label: str = "",
) -> str:
    """Horizontal grouped bars: one group per row, one bar per series (legend on top); ``ref`` draws a
    dashed line (e.g. 1.0× or the model's depth)."""
    bar_h, gap = 13, 10
    group_h = bar_h * len(series) + gap
    legend_h = 22 if len(series) > 1 else 0
    top = 30 + legend_h + (12 if ref is not None else 0)
    height = top + group_h * len(rows) + 30
    values = [v for _, vs in series for v in vs if v is not None]
    vmax = _nice_max(max(values + ([ref] if ref else []) + [0]) * 1.05)
    plot_w = WIDTH - LABEL_W - 70

    def x(v):
        return LABEL_W + plot_w * v / vmax

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    lx = LABEL_W
    for k, (name, _) in enumerate(series if len(series) > 1 else []):
        out.append(
            f'<rect x="{lx}" y="26" width="11" height="11" fill="{PALETTE[k % len(PALETTE)]}"/>'
            f'<text x="{lx + 15}" y="36" font-size="12">{escape(name)}</text>'
        )
        lx += 24 + 7 * len(name)
    for t in _ticks(vmax):
        out.append(
            f'<line x1="{x(t):.1f}" y1="{top - 4}" x2="{x(t):.1f}" y2="{height - 26}" stroke="#eee"/>'
            f'<text x="{x(t):.1f}" y="{height - 12}" font-size="11" text-anchor="middle" fill="#666">'
            f"{format(t, fmt)}{escape(unit)}</text>"
        )
    for i, row in enumerate(rows):
        y0 = top + i * group_h
        out.append(
            f'<text x="{LABEL_W - 8}" y="{y0 + (group_h - gap) / 2 + 4:.1f}" font-size="12" '
            f'text-anchor="end">{escape(row)}</text>'
        )
        for k, (name, vs) in enumerate(series):
            v = vs[i]
            y = y0 + k * bar_h
            if v is None:
                out.append(f'<text x="{LABEL_W + 4}" y="{y + 10}" font-size="10" fill="#999">n/a</text>')
                continue
            color = PALETTE[k % len(PALETTE)]
            out.append(
                f'<rect x="{LABEL_W}" y="{y}" width="{max(0.5, x(v) - LABEL_W):.1f}" height="{bar_h - 2}" '
                f'fill="{color}"><title>{escape(row)} · {escape(name)}: {format(v, fmt)}{escape(unit)}'
                f"</title></rect>"
                f'<text x="{x(v) + 4:.1f}" y="{y + 10}" font-size="10">{format(v, fmt)}{escape(unit)}</text>'
            )
    if ref is not None:
        out.append(
            f'<line x1="{x(ref):.1f}" y1="{top - 4}" x2="{x(ref):.1f}" y2="{height - 26}" stroke="#333" '
            f'stroke-dasharray="4,3"/><text x="{x(ref) + 3:.1f}" y="{top - 6}" font-size="10" fill="#333">'
            f"{escape(ref_label)}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def line_chart(
    title: str,
    xs: list[float],
    ys: list[float],
    xlabel: str,
    ylabel: str,
    fmt: str = ".1f",
    ref: float | None = None,
    ref_label: str = "",
) -> str:
    """Points joined by a line, axes from 0; ``ref`` draws a dashed horizontal line."""
    height, left, bottom, top = 300, 60, 40, 30
    plot_w, plot_h = WIDTH - left - 30, height - top - bottom
    xmax = _nice_max(max(xs))
    ymax = _nice_max(max(ys + ([ref] if ref else [])) * 1.05)

    def px(v):
        return left + plot_w * v / xmax

    def py(v):
        return top + plot_h * (1 - v / ymax)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for t in _ticks(ymax):
        out.append(
            f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{py(t) + 4:.1f}" font-size="11" text-anchor="end" fill="#666">'
            f"{format(t, fmt)}</text>"
        )
    for t in _ticks(xmax):
        out.append(
            f'<text x="{px(t):.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle" '
            f'fill="#666">{t:g}</text>'
        )
    out.append(
        f'<text x="{left + plot_w / 2}" y="{height - 4}" font-size="12" '
        f'text-anchor="middle">{escape(xlabel)}</text>'
        f'<text x="12" y="{top + plot_h / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + plot_h / 2})">{escape(ylabel)}</text>'
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#999"/>'
    )
    if ref is not None:
        out.append(
            f'<line x1="{left}" y1="{py(ref):.1f}" x2="{left + plot_w}" y2="{py(ref):.1f}" stroke="#333" '
            f'stroke-dasharray="4,3"/><text x="{left + plot_w - 4}" y="{py(ref) - 4:.1f}" font-size="10" '
            f'text-anchor="end">{escape(ref_label)}</text>'
        )
    pts = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(xs, ys))
    out.append(f'<polyline points="{pts}" fill="none" stroke="{PALETTE[0]}" stroke-width="2"/>')
    for a, b in zip(xs, ys):
        out.append(
            f'<circle cx="{px(a):.1f}" cy="{py(b):.1f}" r="3.5" fill="{PALETTE[0]}"><title>{a:g}: '
            f"{format(b, fmt)}</title></circle>"
        )
    out.append("</svg>")
    return "".join(out)


def frontier_chart(
    title: str,
    series: list[tuple[str, list[tuple[float, float]], int | None]],
    xlabel: str,
    ylabel: str,
    ref_y: float | None = None,
    ref_label: str = "",
) -> str:
    """Quality against speed: one polyline of points per series (a method's settings in order), the
    point at the series' marked index ringed and labelled (its calibrated setting)."""
    height, left, bottom, top = 320, 60, 40, 50
    plot_w, plot_h = WIDTH - left - 30, height - top - bottom
    pts = [p for _, ps, _ in series for p in ps]
    xmax = _nice_max(max([x for x, _ in pts] + [1.0]) * 1.05)
    ymax = _nice_max(max([y for _, y in pts] + [ref_y or 0, 1.0]))

    def px(v):
        return left + plot_w * v / xmax

    def py(v):
        return top + plot_h * (1 - v / ymax)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    lx = left
    for k, (name, _, _) in enumerate(series):
        out.append(
            f'<rect x="{lx}" y="26" width="11" height="11" fill="{PALETTE[k % len(PALETTE)]}"/>'
            f'<text x="{lx + 15}" y="36" font-size="12">{escape(name)}</text>'
        )
        lx += 24 + 7 * len(name)
    for t in _ticks(ymax):
        out.append(
            f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{py(t) + 4:.1f}" font-size="11" text-anchor="end" fill="#666">'
            f"{t:.2g}</text>"
        )
    for t in _ticks(xmax):
        out.append(
            f'<text x="{px(t):.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle" '
            f'fill="#666">{t:.2g}×</text>'
        )
    out.append(
        f'<text x="{left + plot_w / 2}" y="{height - 4}" font-size="12" text-anchor="middle">{escape(xlabel)}</text>'
        f'<text x="12" y="{top + plot_h / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + plot_h / 2})">{escape(ylabel)}</text>'
        f'<line x1="{px(1):.1f}" y1="{top}" x2="{px(1):.1f}" y2="{top + plot_h}" stroke="#999" '
        f'stroke-dasharray="2,3"/>'
    )
    if ref_y is not None:
        out.append(
            f'<line x1="{left}" y1="{py(ref_y):.1f}" x2="{left + plot_w}" y2="{py(ref_y):.1f}" stroke="#333" '
            f'stroke-dasharray="4,3"/><text x="{left + plot_w - 4}" y="{py(ref_y) - 4:.1f}" font-size="10" '
            f'text-anchor="end">{escape(ref_label)}</text>'
        )
    for k, (name, ps, mark) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        out.append(
            f'<polyline points="{" ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in ps)}" fill="none" '
            f'stroke="{color}" stroke-width="1.5"/>'
        )
        for i, (a, b) in enumerate(ps):
            out.append(
                f'<circle cx="{px(a):.1f}" cy="{py(b):.1f}" r="3" fill="{color}"><title>{escape(name)}: '
                f"{a:.2f}×, {b:.2f}</title></circle>"
            )
            if i == mark:
                out.append(
                    f'<circle cx="{px(a):.1f}" cy="{py(b):.1f}" r="8" fill="none" stroke="{color}" '
                    f'stroke-width="2"/><text x="{px(a) + 10:.1f}" y="{py(b) - 8:.1f}" font-size="11" '
                    f'fill="{color}">{escape(name)} calibrated</text>'
                )
    out.append("</svg>")
    return "".join(out)


def _frontier(cfg: dict) -> str:
    """Each lossy method's calibration: its settings' mean share of greedy's reference score kept (else
    their agreement with greedy) against the modelled speed-up, the chosen setting marked."""
    cals = cfg.get("calibration") or {}
    series = []
    for label, c in cals.items():
        pts, mark = [], None
        for s in c.get("settings", []):
            speed = s.get("modelled_speedup")
            kept = s.get("reference_kept")
            if speed is None:
                continue
            y = kept if kept is not None else s.get("agreement")
            if (c.get("chosen") or {}).get("options") == s.get("options"):
                mark = len(pts)
            pts.append((float(speed), float(y or 0.0)))
        if pts:
            series.append((label, pts, mark))
    if not series:
        return (
            '<p class="note">No lossy method in this run has a calibration file (<code>layerleap calibrate '
            "METHOD</code> writes one).</p>"
        )
    q = next(iter(cals.values())).get("quality")
    notes = "".join(
        f"<li><code>{escape(lb)}</code>: {escape(str(c.get('guarantee')))}"
        + ("" if c.get("faster_than_greedy") else " (no setting faster than greedy met the budget)")
        + "</li>"
        for lb, c in cals.items()
    )
    return (
        frontier_chart(
            "quality against speed: each setting calibration measured",
            series,
            "modelled speed-up (layer passes, calls and checks priced as step_cost measured them)",
            "reference score kept (else agreement)",
            q,
            f"budget {q}",
        )
        + '<p class="note">The calibration split\'s settings in the order Learn-then-Test walks them; the ringed '
        "point is the setting the method runs at the default budget.</p><ul>" + notes + "</ul>"
    )


# -- the page ------------------------------------------------------------------------------------------
def _share(share: float | None) -> str | None:
    return None if share is None else f"{share:.0%} of the CPUs during the run"


def _facts(cfg: dict) -> str:
    load = cfg.get("load_average")
    rows = [
        ("model", f"{cfg.get('model')} ({cfg.get('source') or '-'}; fingerprint {cfg.get('fingerprint', '-')})"),
        ("dtype", cfg.get("dtype")),
        ("threads", f"{cfg.get('threads')} of {cfg.get('cpu_cores')} cores"),
        ("CPU", cfg.get("cpu", cfg.get("machine"))),
        ("platform", cfg.get("platform")),
        ("load average", ", ".join(f"{x:.2f}" for x in load) if load else None),
        ("other processes", _share(cfg.get("other_cpu_share"))),
        ("software", f"python {cfg.get('python')}, torch {cfg.get('torch')}, transformers {cfg.get('transformers')}"),
        (
            "run",
            f"{cfg.get('n_prompts')} prompts ({', '.join(cfg.get('categories') or []) or '-'}) × "
            f"{cfg.get('max_new_tokens')} new tokens, chat {cfg.get('chat')}, "
            f"sampling {cfg.get('sampling') or '-'}",
        ),
        ("date", cfg.get("date")),
    ]
    return (
        "<table class=facts>"
        + "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows if v is not None)
        + "</table>"
    )


def _summary_table(summary: dict) -> str:
    head = [
        "method",
        "prompts",
        "tok/s",
        "vs greedy",
        "vs transformers",
        "layers/token",
        "tokens/call",
        "acceptance",
        "first token s",
        "= greedy",
        "= transformers",
    ]
    quality = any(s.get("agreement") is not None for s in summary.values())
    if quality:
        head += ["agreement", "reference kept", "perplexity ×"]
    rows = []
    for label, s in summary.items():
        cells = [
            label,
            str(s["prompts"]),
            _fmt(s.get("tokens_per_s"), ".1f"),
            _fmt(s.get("speedup_vs_greedy"), ".2f", "×"),
            _fmt(s.get("speedup_vs_hf"), ".2f", "×"),
            _fmt(s.get("layers_per_token"), ".1f"),
            _fmt(s.get("tokens_per_call"), ".2f"),
            _fmt(s.get("acceptance"), ".0%"),
            _fmt(s.get("mean_ttft_s"), ".3f"),
            s.get("matches_greedy") or "-",
            s.get("matches_hf") or "-",
        ]
        if quality:
            cells += [
                _fmt(s.get("agreement"), ".2f"),
                _fmt(s.get("reference_kept"), ".0%"),
                _fmt(s.get("ppl_ratio"), ".2f", "×"),
            ]
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def _call_cost(cc: dict | None) -> str:
    if not cc or not cc.get("points"):
        return (
            '<p class="note">Not measured: this bench report holds no <code>call_cost</code> (the time of one '
            "model call by the number of new tokens it takes).</p>"
        )
    pts = sorted(cc["points"], key=lambda p: p["new_tokens"])
    xs = [float(p["new_tokens"]) for p in pts]
    threads = cc.get("threads")
    where = f"context of {cc.get('context')} tokens, {threads} thread{'' if threads == 1 else 's'}, {cc.get('dtype')}"
    return (
        f'<p class="note">One model call over a {escape(where)}: what drafting methods pay to verify several '
        "tokens at once.  A flat curve means extra tokens per call are nearly free.</p>"
        + line_chart(
            "milliseconds per model call", xs, [float(p["ms"]) for p in pts], "new tokens in the call", "ms", ".1f"
        )
        + line_chart(
            "cost relative to a one-token call",
            xs,
            [float(p["ratio"]) for p in pts],
            "new tokens in the call",
            "× one token",
            ".2f",
            ref=1.0,
            ref_label="1× (free)",
        )
    )


def _failures(failures: list[dict]) -> str:
    """The runs that raised (a method failing on a prompt), one line per method; '' when none did."""
    if not failures:
        return ""
    items = "".join(f"<li>{escape(line)}</li>" for line in failure_lines(failures))
    return (
        f'<p class="note">{len(failures)} run{"" if len(failures) == 1 else "s"} failed; the summary compares '
        f"each method on the prompts it finished:</p><ul>{items}</ul>"
    )


def _reference(summary: dict) -> str:
    """The label of the greedy reference in a bench summary: as ``bench.with_reference`` picks it, the first
    plain greedy run (no options; ``--methods g=greedy`` labels it ``g``), else ``greedy``."""
    return next(
        (lb for lb, s in summary.items() if s.get("method") == REFERENCE and not s.get("options")),
        REFERENCE,
    )


def html_report(report: dict, title: str | None = None) -> str:
    """The HTML page of a bench report dict (see the module docstring)."""
    from .. import __version__

    cfg, summary = report.get("config", {}), report.get("summary", {})
    labels = list(summary)
    by_cat = report.get("summary_by_category", {})
    cats = [c for c in by_cat if c] or []
    title = title or f"layerleap bench: {cfg.get('model', '?')}"
    series = [(c, [by_cat[c].get(lb, {}).get("tokens_per_s") for lb in labels]) for c in cats]
    series.append(("all prompts", [summary[lb].get("tokens_per_s") for lb in labels]))
    ours = [lb for lb in labels if lb != HF_LABEL]
    drafting = [lb for lb in ours if summary[lb].get("acceptance") is not None]
    depth = summary.get(_reference(summary), {}).get("layers_per_token")
    parts = [
        f"<h1>{escape(title)}</h1>",
        f"<pre>$ {escape(str(cfg.get('command') or '(command not recorded)'))}</pre>",
        _facts(cfg),
        ""
        if report.get("complete", True)
        else f'<p class="note">Interrupted: {report.get("prompts_done")} of '
        f"{cfg.get('n_prompts')} prompts finished.</p>",
        _failures(report.get("failures") or []),
        "<h2>Summary</h2>",
        _summary_table(summary),
        '<p class="note">Speed-ups are ratios of summed wall time over the same prompts; tokens/s, tokens/call, '
        "layers/token and acceptance are ratios of sums over the prompts too (kept draft tokens over proposed "
        'ones); "= greedy" counts the greedy-decoding runs whose tokens equal plain greedy decoding\'s.  Lossy '
        "methods' quality: agreement is ROUGE-L F1 against greedy's own text; reference kept is the method's "
        "summed reference score (ROUGE-L, sentence BLEU, exact match of the final answer) over greedy's on the "
        "prompts with references; perplexity × is the full model's mean perplexity of the method's outputs over "
        "that of greedy's.</p>",
        "<h2>Lossy methods: quality against speed</h2>",
        _frontier(cfg),
        "<h2>Tokens per second by method and category</h2>",
        hbar_chart("tokens/s (summed tokens over summed time)", labels, series, ".1f"),
        "<h2>Speed against greedy and transformers</h2>",
        hbar_chart(
            "speed-up (summed time of the baseline / summed time of the method)",
            ours,
            [
                ("vs greedy", [summary[lb].get("speedup_vs_greedy") for lb in ours]),
                ("vs transformers", [summary[lb].get("speedup_vs_hf") for lb in ours]),
            ],
            ".2f",
            "×",
            1.0,
            "1×",
        ),
        "<h2>Drafting: acceptance and tokens per model call</h2>",
        hbar_chart(
            "accepted share of proposed draft tokens",
            drafting,
            [("acceptance", [100 * summary[lb]["acceptance"] for lb in drafting])],
            ".0f",
            "%",
        )
        if drafting
        else '<p class="note">No drafting method in this run.</p>',
        hbar_chart(
            "new tokens per model call",
            ours,
            [("tokens/call", [summary[lb].get("tokens_per_call") for lb in ours])],
            ".2f",
            "",
            1.0,
            "1 (greedy)",
        ),
        "<h2>Layers per token</h2>",
        hbar_chart(
            "token-layer evaluations per generated token (rejected drafts included)",
            labels,
            [("layers/token", [summary[lb].get("layers_per_token") for lb in labels])],
            ".1f",
            "",
            depth,
            f"{depth:g} layers (full depth)" if depth else "",
        ),
        "<h2>Call cost</h2>",
        _call_cost(report.get("call_cost")),
        f'<p class="note">Written by layerleap {escape(__version__)}.</p>',
    ]
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{CSS}</style></head><body>" + "\n".join(parts) + "</body></html>\n"
    )


def write_html_report(report: dict, path) -> None:
    from ..files import write_text

    write_text(path, html_report(report))
