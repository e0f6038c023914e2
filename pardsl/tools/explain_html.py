"""`pardsl explain --html`: the explain report as one self-contained page, with pictures of the mesh and of
where each layer's communication happens."""

from __future__ import annotations

import html

from pardsl.planning.cost import Estimate
from pardsl.program.ir import format_bytes
from pardsl.tools.explain import Layer, layers, report, seconds_text


_STYLE = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}
td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;font-variant-numeric:tabular-nums}
h2{margin-top:1.5em}.num{text-align:right}pre{background:#f6f6f6;padding:1em;white-space:pre-wrap}"""
_COLOURS = {"all_reduce": "#d9534f", "all_gather": "#5bc0de", "reduce_scatter": "#f0ad4e", "all_to_all": "#9b59b6"}


def _mesh_svg(mesh) -> str:
    """The ranks as a grid: the first axis down, the others across (their product)."""
    rows = mesh.axis_sizes[0] if mesh.ndim > 1 else 1
    cols = mesh.size // rows
    cell = 56
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * cell + 20}" height="{rows * cell + 40}">']
    for rank in range(mesh.size):
        r, c = divmod(rank, cols)
        coords = ", ".join(f"{n}{i}" for n, i in zip(mesh.axis_names, mesh.coordinates(rank)))
        parts.append(f'<rect x="{10 + c * cell}" y="{10 + r * cell}" width="{cell - 6}" height="{cell - 6}" '
                     f'fill="#eef" stroke="#447"/><text x="{13 + c * cell}" y="{30 + r * cell}" font-size="12">'
                     f'rank {rank}</text><text x="{13 + c * cell}" y="{46 + r * cell}" font-size="10">'
                     f'{html.escape(coords)}</text>')
    axes = (f"{mesh.axis_names[0]} down, {' × '.join(mesh.axis_names[1:])} across" if mesh.ndim > 1
            else f"{mesh.axis_names[0]} across")
    parts.append(f'<text x="10" y="{rows * cell + 30}" font-size="12">{html.escape(axes)}</text></svg>')
    return "".join(parts)


def _layers_svg(all_layers: list[Layer]) -> str:
    """One bar per layer: compute in grey, each collective a segment in its kind's colour."""
    width, row = 640, 22
    scale = width / max(max((l.compute_s + sum(c.seconds for c in l.collectives)) for l in all_layers), 1e-12)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 260}" height="{row * len(all_layers) + 30}">']
    for index, layer in enumerate(all_layers):
        y = 10 + index * row
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(layer.name or "(outside)")}</text>')
        x = 220.0
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{layer.compute_s * scale:.1f}" height="16" fill="#bbb">'
                     f'<title>compute {seconds_text(layer.compute_s)}</title></rect>')
        x += layer.compute_s * scale
        for cost in layer.collectives:
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(cost.seconds * scale, 1):.1f}" height="16" '
                         f'fill="{_COLOURS[cost.kind]}"><title>{html.escape(cost.kind)} {cost.axis} {cost.phase} '
                         f'{format_bytes(cost.bytes)} {seconds_text(cost.seconds)}: {html.escape(cost.reason)}'
                         f'</title></rect>')
            x += max(cost.seconds * scale, 1)
    parts.append("</svg>")
    return "".join(parts)


def html_page(compiled, estimate: Estimate, memory_bound: int | None = None) -> str:
    """One self-contained page: no script, no external resource."""
    program = compiled.program
    all_layers = layers(compiled, estimate)
    legend = " ".join(f'<span style="background:{c};padding:0 6px;color:#fff">{k.replace("_", "-")}</span>'
                      for k, c in _COLOURS.items())
    rows = []
    for layer in all_layers:
        for cost in layer.collectives:
            rows.append(f"<tr><td>{html.escape(layer.name or '(outside)')}</td><td>{cost.kind.replace('_', '-')}</td>"
                        f"<td>{cost.axis}</td><td>{cost.phase}{', overlapped' if cost.overlapped else ''}</td>"
                        f"<td class=num>{format_bytes(cost.bytes)}</td><td class=num>{seconds_text(cost.seconds)}</td>"
                        f"<td>{html.escape(cost.reason)}</td></tr>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pardsl explain: {html.escape(program.source_path)}</title>
<style>{_STYLE}</style></head><body>
<h1>{html.escape(program.source_path)}</h1>
<p>mesh {html.escape(str(program.mesh))} ({program.mesh.size} ranks), model <code>{html.escape(program.model)}</code></p>
<h2>Mesh</h2>{_mesh_svg(program.mesh)}
<h2>Layers and where communication happens</h2><p>compute in grey; {legend}</p>
{_layers_svg(all_layers)}
<h2>Collectives</h2><table><tr><th>layer</th><th>collective</th><th>axis</th><th>phase</th><th>bytes per rank</th>
<th>estimated</th><th>why</th></tr>{''.join(rows)}</table>
<h2>Report</h2><pre>{html.escape(report(compiled, estimate, memory_bound))}</pre>
</body></html>
"""
