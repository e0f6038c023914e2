"""`pardsl explain --html`: the page's pictures (pardsl/tools/explain_html.py), their numbers against the
cost model's estimate, the page's structure, and the page as headless Chromium draws it, checked pixel by
pixel at the places the page puts its pictures."""

import functools
import html
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import xml.etree.ElementTree as ElementTree
import zlib

import numpy as np
import pytest

from pardsl.compiler import compile_file, compile_text
from pardsl.layouts.algebra import COLLECTIVE_KINDS
from pardsl.planning.cost import LinkCost, Machine, estimate, machine_named, pipeline_rank_memory
from pardsl.tools import explain_html
from pardsl.tools.explain import layers
from pardsl.tools.explain_html import (
    BOUND, CHAR, FONT, IDLE, LABELS, MEMORY_COLOURS, PICTURE_GAP, PICTURES_LEFT, PICTURES_TOP, SERIAL, TIMELINE_COLOURS,
    html_page, memory_bars, step_timeline)

# Round figures; overlap 0.5 so that gradient buckets are partly hidden and partly exposed
MACHINE = Machine("gloo", {k: LinkCost(1e-4, 1e-9) for k in COLLECTIVE_KINDS}, 1e10, 1e9, 1e-6, "test", overlap=0.5)
SVG = "{http://www.w3.org/2000/svg}"

# examples/mlp_dp.par: data parallelism over 2 ranks, no forward communication, gradient buckets beside
# backward; drawn against a bound given as `pardsl explain` gives it
MLP_DP = "examples/mlp_dp.par"
MLP_DP_BOUND = 10 << 20


@functools.lru_cache(maxsize=None)
def _compiled(path: str):
    return compile_file(path)


def _planned(path: str):
    compiled = _compiled(path)
    return compiled, estimate(compiled, MACHINE)


def _picture(page: str, name: str) -> ElementTree.Element:
    found = re.search(rf'<svg [^>]*id="{name}".*?</svg>', page, re.S)
    return ElementTree.fromstring(found.group(0))


def _rects(svg: ElementTree.Element, kind: str) -> list[ElementTree.Element]:
    return [rect for rect in svg.iter(f"{SVG}rect") if kind in rect.get("class", "").split()]


# The pictures' numbers


def test_the_timeline_adds_up_to_the_estimate_forward_then_backward():
    compiled, result = _planned(MLP_DP)
    seconds = result.seconds
    timeline = step_timeline(compiled, result)
    assert timeline.lanes == ["both ranks", "beside compute"]

    def total(kind, lane=None):
        return sum(b.seconds for b in timeline.blocks if b.kind == kind and lane in (None, b.lane))

    assert math.isclose(total("forward"), seconds["compute_forward"])
    assert math.isclose(total("backward"), seconds["compute_backward"])
    assert math.isclose(total("communication", lane=1), seconds["overlapped"])  # the gradient buckets
    assert seconds["overlapped_exposed"] > 0 and math.isclose(
        total("exposed"), seconds["communication_forward"] + seconds["communication_backward"]
        + seconds["overlapped_exposed"])
    assert math.isclose(timeline.end, seconds["step"])
    compute = sorted((b for b in timeline.blocks if b.lane == 0), key=lambda b: b.start)
    for before, after in zip(compute, compute[1:]):  # one lane: back to back, never on top of each other
        assert math.isclose(before.start + before.seconds, after.start, abs_tol=1e-12)
    assert [b.kind for b in compute] == sorted((b.kind for b in compute), key=["forward", "backward", "exposed"].index)
    forward_end = max(b.start + b.seconds for b in compute if b.kind == "forward")
    assert all(b.start >= forward_end for b in timeline.blocks if b.kind == "communication")  # backward's buckets


def test_a_tensor_parallel_step_waits_for_its_all_reduces_in_program_order():
    compiled, result = _planned("examples/mlp.par")
    timeline = step_timeline(compiled, result)
    assert timeline.lanes == ["both ranks"]  # nothing beside compute
    order = [(b.kind, b.title.split(":")[0]) for b in sorted(timeline.blocks, key=lambda b: b.start)]
    assert order == [("forward", "fc1"), ("forward", "(outside the layers)"), ("forward", "fc2"), ("exposed", "fc2"),
                     ("backward", "fc2"), ("backward", "(outside the layers)"), ("backward", "fc1")]
    assert math.isclose(timeline.end, result.seconds["step"])


def test_a_pipeline_lays_out_its_micro_batches_by_its_schedule():
    compiled, result = _planned("examples/hf_llama_pp2.par")  # 1F1B, 4 micro-batches, 2 stages
    timeline = step_timeline(compiled, result)
    assert timeline.lanes == ["pp0: stage 0", "pp1: stage 1"]
    lanes = [[b.labels[0] for b in sorted(timeline.blocks, key=lambda b: b.start) if b.lane == rank]
             for rank in range(2)]
    assert lanes == [["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],  # 2 micro-batches in flight
                     ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]]
    at = {(b.lane, b.labels[0]): b for b in timeline.blocks}
    for i in range(4):  # stage 1 waits for stage 0's activations, stage 0 for stage 1's gradients
        assert at[1, f"F{i}"].start > at[0, f"F{i}"].start + at[0, f"F{i}"].seconds
        assert at[0, f"B{i}"].start > at[1, f"B{i}"].start + at[1, f"B{i}"].seconds
    assert at[1, "F0"].start > 0  # the bubble: stage 1 idle until its first micro-batch arrives
    # the model's estimate of the pipelined step and this layout agree to within the sends it leaves out
    assert "The pipeline search's estimate of the step" in " ".join(timeline.notes)
    assert [m for _, m in memory_bars(compiled, result)] == [pipeline_rank_memory(compiled.stages, compiled.pipeline, r)
                                                             for r in range(2)]


@pytest.mark.parametrize("schedule, ranks, stages, rank, expected", [
    ("GPipe", 2, 2, 0, "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2"),
    ("1F1B", 3, 3, 0, "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3"),
    ("1F1B", 3, 3, 2, "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3"),
    ("LoopedBFS", 2, 4, 1, "F1.0 F1.1 F3.0 F3.1 B3.1 B3.0 B1.1 B1.0"),
    # torch's Interleaved1F1B: rounds of 2 micro-batches through stage 0 then 2; warm-up (2-1)·2 + 2·(2-1-0)
    ("Interleaved1F1B", 2, 4, 0, "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"),
])
def test_each_schedule_orders_a_ranks_work_as_torch_runs_it(schedule, ranks, stages, rank, expected):
    m = 3 if schedule == "GPipe" else 4 if schedule != "LoopedBFS" else 2
    order = explain_html._rank_orders(schedule, ranks, stages, m)[rank]
    assert " ".join(f"{kind}{stage}.{i}" for kind, stage, i in order) == expected


@pytest.mark.parametrize("schedule, orders", [("1F1B", True), ("ZBVZeroBubble", False)])
def test_a_laid_out_pipeline_runs_each_action_once_after_what_it_needs(schedule, orders):
    ranks, stages, m = 2, 4 if schedule == "ZBVZeroBubble" else 2, 4
    duration = {"F": [1.0, 2.0, 1.5, 1.0][:stages], "B": [2.0, 4.0, 3.0, 2.0][:stages]}
    sent, returned = [0.0] + [0.25] * (stages - 1), [0.5] * (stages - 1) + [0.0]
    given = explain_html._rank_orders(schedule, ranks, stages, m)
    assert (given is not None) == orders  # the V-shaped schedules: a greedy order
    done = explain_html._laid_out(given, ranks, stages, m, schedule, duration, sent, returned)
    assert set(done) == {(kind, s, i) for kind in "FB" for s in range(stages) for i in range(m)}
    for (kind, s, i), (start, end) in done.items():
        assert math.isclose(end - start, duration[kind][s])
        if kind == "F" and s > 0:
            assert start >= done["F", s - 1, i][1] + sent[s]
        if kind == "B":
            assert start >= done["F", s, i][1]
            if s < stages - 1:
                assert start >= done["B", s + 1, i][1] + returned[s]
    for rank in range(ranks):  # a rank runs one action at a time
        from pardsl.runtime.schedules import rank_of_stage
        spans = sorted(span for (_, s, _), span in done.items() if rank_of_stage(s, ranks, schedule) == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


# The page's structure


def test_the_page_is_self_contained_with_its_outside_text_escaped(tmp_path):
    path = str(tmp_path / '<b>&"x".par')
    with open(MLP_DP) as source:
        compiled = compile_text(source.read(), path)
    page = html_page(compiled, estimate(compiled, MACHINE), MLP_DP_BOUND)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page.lower()
    assert not re.search(r"\b(src|href)=|url\(|@import", page)
    assert set(re.findall(r"[a-z]+://[^\s\"'<>]*", page)) == {"http://www.w3.org/2000/svg"}  # a namespace only
    assert "<b>&" not in page and html.escape(path) in page
    assert page.count("<svg") == 4  # the timeline, memory, the mesh and the layers
    timeline, memory = _picture(page, "timeline"), _picture(page, "memory")
    assert timeline.find(f"{SVG}title").text == "A step as a timeline per rank"
    assert memory.find(f"{SVG}title").text == "Memory per rank against the bound"
    texts = [t.text for t in timeline.iter(f"{SVG}text")]
    assert "time (µs)" in texts or "time (ms)" in texts
    assert all(_rects(timeline, kind) for kind in TIMELINE_COLOURS)
    assert {s.get("data-key") for s in _rects(timeline, "swatch")} == set(TIMELINE_COLOURS) | {"idle"}
    assert [line.get("class") for line in memory.iter(f"{SVG}line") if line.get("class") == "bound"] == ["bound"]
    assert any(t.text.startswith("bytes per rank") for t in memory.iter(f"{SVG}text"))
    for rect in _rects(timeline, "forward") + _rects(memory, "memory"):
        assert rect.find(f"{SVG}title").text  # each block says what it is and what it costs
    # the mesh and the layers below the pictures
    assert ">dp0<" in page and ">dp1<" in page
    drawn = layers(compiled, estimate(compiled, MACHINE))
    assert all(f">{html.escape(layer.name or '(outside)')}<" in page for layer in drawn)


def test_the_memory_picture_draws_each_part_the_estimate_counts():
    compiled, result = _planned(MLP_DP)
    memory = _picture(html_page(compiled, result, MLP_DP_BOUND), "memory")
    drawn = {rect.get("class").split()[1]: float(rect.get("width")) for rect in _rects(memory, "memory")}
    parts = {k: v for k, v in result.memory.items() if k in MEMORY_COLOURS and v}
    assert set(drawn) == set(parts)
    scale = drawn["parameters"] / parts["parameters"]
    assert all(math.isclose(drawn[k], v * scale, rel_tol=1e-3) for k, v in parts.items())
    [bound] = [line for line in memory.iter(f"{SVG}line") if line.get("class") == "bound"]
    assert abs(float(bound.get("x1")) - (LABELS + MLP_DP_BOUND * scale)) <= 0.5
    [serial] = _rects(memory, "serial")
    assert math.isclose(float(serial.get("width")), result.memory["serial_total"] * scale, rel_tol=1e-3)


def _text_overlaps(svg: ElementTree.Element) -> list[tuple[str, str]]:
    """Pairs of texts on one line whose extents, at the generous width per character the page lays text out
    by, overlap."""
    spans = []
    for text in svg.iter(f"{SVG}text"):
        width = len(text.text) * CHAR * float(text.get("font-size", FONT)) / FONT
        x = float(text.get("x")) - {"start": 0, "middle": width / 2, "end": width}[text.get("text-anchor", "start")]
        spans.append((float(text.get("y")), x, x + width, text.text))
    return [(a[3], b[3]) for i, a in enumerate(spans) for b in spans[i + 1:]
            if abs(a[0] - b[0]) < FONT and a[1] < b[2] and b[1] < a[2]]


def test_an_8b_plan_on_h100s_is_drawn_in_seconds_and_gib_with_the_device_and_serial_past_the_scale():
    machine = machine_named("h100-nvlink-ib")
    compiled = compile_file("examples/scale/llama3_8b_fsdp8.par", machine=machine)
    result = estimate(compiled, machine)
    page = html_page(compiled, result, compiled.memory_bound)
    timeline, memory = _picture(page, "timeline"), _picture(page, "memory")
    assert math.isclose(step_timeline(compiled, result).end, result.seconds["step"])
    assert "time (s)" in [t.text for t in timeline.iter(f"{SVG}text")]
    assert "bytes per rank (GiB)" in [t.text for t in memory.iter(f"{SVG}text")]
    [device] = [line for line in memory.iter(f"{SVG}line") if line.get("class") == "device"]
    [parameters] = _rects(memory, "parameters")
    scale = float(parameters.get("width")) / result.memory["parameters"]
    assert abs(float(device.get("x1")) - (LABELS + machine.device_memory_bytes * scale)) <= 0.5
    [serial] = _rects(memory, "serial")  # 972 GiB: broken at the plot's edge, its size written on it
    assert float(serial.get("width")) < result.memory["serial_total"] * scale / 5
    assert any(t.text.endswith("past the scale") for t in memory.iter(f"{SVG}text"))
    assert _text_overlaps(timeline) == [] and _text_overlaps(memory) == []


def test_offloaded_memory_is_drawn_apart_as_host_memory():
    with open("examples/hf_llama_tp2.par") as source:
        compiled = compile_text(source.read() + "\nprecision params bf16, reduce fp32\noffload optimizer\n",
                                "offloaded.par")
    result = estimate(compiled, MACHINE)
    memory = _picture(html_page(compiled, result), "memory")
    assert "Host memory (offloaded), per rank, on the same scale" in [t.text for t in memory.iter(f"{SVG}text")]
    rows = sorted({float(r.get("y")) for r in _rects(memory, "memory")})
    assert len(rows) == 2  # the device's bar, then the host's
    device, host = ([r for r in _rects(memory, "memory") if float(r.get("y")) == y] for y in rows)
    assert {r.get("class").split()[1] for r in device} == {k for k in MEMORY_COLOURS if result.memory.get(k)}
    assert {r.get("class").split()[1] for r in host} == {"parameters", "gradients", "optimizer_state"}
    [serial] = _rects(memory, "serial")
    scale = float(serial.get("width")) / result.memory["serial_total"]
    assert math.isclose(sum(float(r.get("width")) for r in host), result.memory["host_total"] * scale, rel_tol=1e-3)


# The page in a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _png_pixels(path) -> np.ndarray:
    """A PNG's pixels as an array of rows of RGB, from its chunks: 8-bit RGB or RGBA, not interlaced (what
    Chromium writes), unfiltered row by row."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, compressed = 8, b""
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and not interlace
        compressed += body if kind == b"IDAT" else b""
        position += 12 + length
    channels = 3 if colour == 2 else 4
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(compressed), np.uint8).reshape(height, stride + 1)
    rows = np.zeros((height, stride), np.int32)
    previous = np.zeros(stride, np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: each byte plus the one a pixel to its left, a running sum per channel
            row = np.cumsum(line.reshape(width, channels), axis=0).reshape(stride) % 256
        elif kind == 2:  # Up
            row = (line + previous) % 256
        else:  # Average, Paeth: byte by byte
            row = np.zeros(stride, np.int32)
            for x in range(stride):
                a = row[x - channels] if x >= channels else 0
                b, c = previous[x], previous[x - channels] if x >= channels else 0
                if kind == 3:
                    row[x] = (line[x] + (a + b) // 2) % 256
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    row[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) % 256
        rows[y] = previous = row
    return rows.reshape(height, width, channels)[:, :, :3]


def _screenshot(page: str, tmp_path, width: int, height: int) -> np.ndarray:
    """The page as headless Chromium draws it (flags: no sandbox as root, no network of its own, which
    would wait on refused connections); its process group ended whatever happens."""
    (tmp_path / "plan.html").write_text(page, encoding="utf-8")
    shot = tmp_path / "shot.png"
    process = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
         f"--window-size={width},{height}", (tmp_path / "plan.html").as_uri()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=60)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # its helpers, should any outlive it
        except ProcessLookupError:
            pass
        process.wait()
    assert shot.exists(), output.decode(errors="replace")[-2000:]
    return _png_pixels(shot)


def _colour(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def _picture_tops(page: str) -> dict[str, int]:
    """Where each picture starts on the page: the first at PICTURES_TOP, each next one PICTURE_GAP below."""
    tops, top = {}, PICTURES_TOP
    for name in ("timeline", "memory"):
        tops[name] = top
        top += int(_picture(page, name).get("height")) + PICTURE_GAP
    return tops


def _inside(rect: ElementTree.Element, top: int, below: float = 0.5) -> tuple[int, int]:
    """A pixel of `rect` on the page: its middle across, `below` of the way down."""
    return (int(PICTURES_LEFT + float(rect.get("x")) + float(rect.get("width")) / 2),
            int(top + float(rect.get("y")) + float(rect.get("height")) * below))


def _check_colours(pixels, svg, top: int, kinds: dict[str, str]) -> None:
    """The widest block of each kind shows its colour at its centre, and each legend swatch its own."""
    for kind, colour in kinds.items():
        widest = max(_rects(svg, kind), key=lambda r: float(r.get("width")))
        assert float(widest.get("width")) >= 4, kind
        x, y = _inside(widest, top, below=0.2)  # above a micro-batch's name written in it
        assert tuple(pixels[y, x]) == _colour(colour), (kind, x, y)
    for swatch in _rects(svg, "swatch"):
        x, y = _inside(swatch, top)
        assert tuple(pixels[y, x]) == _colour(swatch.get("fill")), swatch.get("data-key")


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y "
                                    "chromium; .ci/run installs it)")


@needs_chromium
def test_chromium_draws_the_timeline_and_the_memory_against_the_bound(tmp_path):
    compiled, result = _planned(MLP_DP)
    page = html_page(compiled, result, MLP_DP_BOUND)
    tops = _picture_tops(page)
    timeline, memory = _picture(page, "timeline"), _picture(page, "memory")
    pixels = _screenshot(page, tmp_path, PICTURES_LEFT + 1000, tops["memory"] + int(memory.get("height")) + 20)
    assert _text_overlaps(timeline) == [] and _text_overlaps(memory) == []
    _check_colours(pixels, timeline, tops["timeline"], TIMELINE_COLOURS)
    parts = {k: c for k, c in MEMORY_COLOURS.items() if result.memory.get(k)}
    _check_colours(pixels, memory, tops["memory"], parts | {"serial": SERIAL})
    [bound] = [line for line in memory.iter(f"{SVG}line") if line.get("class") == "bound"]
    x = PICTURES_LEFT + int(bound.get("x1"))
    for y in range(tops["memory"] + int(bound.get("y1")) + 1, tops["memory"] + int(bound.get("y2")) - 1):
        assert tuple(pixels[y, x]) == _colour(BOUND), y  # the line across every bar


@needs_chromium
def test_chromium_draws_a_pipelines_micro_batches_and_its_bubble(tmp_path):
    compiled, result = _planned("examples/hf_llama_pp2.par")
    page = html_page(compiled, result, compiled.memory_bound)
    tops = _picture_tops(page)
    timeline, memory = _picture(page, "timeline"), _picture(page, "memory")
    pixels = _screenshot(page, tmp_path, PICTURES_LEFT + 1000, tops["memory"] + int(memory.get("height")) + 20)
    assert _text_overlaps(timeline) == [] and _text_overlaps(memory) == []
    _check_colours(pixels, timeline, tops["timeline"], {k: TIMELINE_COLOURS[k] for k in ("forward", "backward")})
    assert len(_rects(timeline, "forward")) == len(_rects(timeline, "backward")) == 8  # 4 micro-batches, 2 stages
    # stage 1 waits for its first micro-batch: its lane starts idle
    [_, second] = _rects(timeline, "lane")
    assert tuple(pixels[tops["timeline"] + int(second.get("y")) + 10, PICTURES_LEFT + LABELS + 3]) == _colour(IDLE)
    _check_colours(pixels, memory, tops["memory"], {"stage_buffers": MEMORY_COLOURS["stage_buffers"],
                                                    "activations": MEMORY_COLOURS["activations"]})
    assert len([r for r in _rects(memory, "parameters")]) == 2  # a bar for each stage's rank
