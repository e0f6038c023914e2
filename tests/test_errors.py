"""Malformed and ill-typed .par files: every error has a code, a line and a column, and all are reported."""

import subprocess
import sys

import pytest
import torch

from pardsl.language.diagnostics import ERROR_CODES, CompileError

MLP = "mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
MESH2 = "mesh dp = 2, tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"


def layout(*entries, head=MLP):
    return head + "layout {\n" + "".join(f"  {e}\n" for e in entries) + "}\n"


CASES = [
    # (id, text, [(code, line, column), ...])
    ("syntax-missing-int", "mesh tp = \nmodel m:f\n", [("E001", 1, 11)]),
    ("syntax-bad-placement", layout("x : Q"), [("E001", 5, 7)]),
    ("syntax-split-needs-int", layout("x : S(a)"), [("E001", 5, 9)]),
    ("syntax-unclosed-block", MLP + "layout {\n  x : B\n", [("E001", 5, 8)]),
    ("syntax-bad-char", "mesh tp = 2 $\nmodel m:f\n", [("E002", 1, 13)]),
    ("syntax-two-lines", "mesh tp = 2\nmodel m:f(\ninput x float32[2]\n", [("E001", 2, 11), ("E001", 3, 9)]),
    ("mesh-twice", "mesh tp = 2\nmesh dp = 2\nmodel m:f\n", [("E003", 2, 1)]),
    ("model-twice", "mesh tp = 2\nmodel m:f\nmodel m:g\n", [("E003", 3, 1)]),
    ("input-twice", MLP + "input x : float32[4, 16]\n", [("E003", 4, 1)]),
    ("no-model", "mesh tp = 2\n", [("E004", 1, 1)]),
    ("no-mesh", "model m:f\n", [("E004", 1, 1)]),
    ("axis-twice", "mesh tp = 2, tp = 2\nmodel examples.models:MLP()\ninput x : float32[4, 256]\n", [("E010", 1, 14)]),
    ("axis-size-zero", "mesh tp = 0\nmodel examples.models:MLP()\ninput x : float32[4, 256]\n", [("E011", 1, 6)]),
    ("module-missing", "mesh tp = 2\nmodel no_such_module:MLP()\n", [("E020", 2, 1)]),
    ("factory-missing", "mesh tp = 2\nmodel examples.models:MPL()\n", [("E021", 2, 23)]),
    ("factory-raises", "mesh tp = 2\nmodel tests.zoo:broken(a=1)\n", [("E022", 2, 1)]),
    ("factory-not-module", "mesh tp = 2\nmodel tests.zoo:not_a_module\n", [("E022", 2, 1)]),
    ("unknown-dtype", "mesh tp = 2\nmodel examples.models:MLP()\ninput x : flaot32[4, 256]\n", [("E030", 3, 11)]),
    ("range-on-float", "mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[4, 256] in [0, 4)\n", [("E031", 3, 27)]),
    ("int-without-range", "mesh tp = 2\nmodel examples.models:MLP()\ninput x : int64[4, 256]\n", [("E032", 3, 11)]),
    ("empty-range", "mesh tp = 2\nmodel examples.models:MLP()\ninput x : int64[4, 256] in [3, 3)\n", [("E033", 3, 25)]),
    ("input-name-mismatch", "mesh tp = 2\nmodel examples.models:MLP()\ninput y : float32[4, 256]\n", [("E034", 3, 1)]),
    ("input-missing", "mesh tp = 2\nmodel examples.models:MLP()\n", [("E034", 2, 1)]),
    ("too-many-inputs", MLP + "input z : float32[4]\n", [("E034", 4, 1)]),
    # LLaMA's forward takes **kwargs and passes them to its layers: a name none of them reads is refused
    ("input-unread-in-kwargs", "mesh tp = 2\nmodel examples.hf_models:llama_causal_lm(layers=1)\n"
                               "input input_ids : int64[2, 8] in [0, 256)\ninput t_cnd : float32[1, 64]\n",
     [("E034", 4, 1)]),
    # ... and one all but a named argument's is its misspelling, said before the trace
    ("input-misspelt-beside-kwargs", "mesh tp = 2\nmodel examples.hf_models:llama_causal_lm(layers=1)\n"
                                     "input input_id : int64[2, 8] in [0, 256)\n", [("E034", 3, 1)]),
    ("dim-without-size", "mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[batch, 256]\n", [("E005", 3, 19)]),
    ("dim-two-sizes", "mesh tp = 2\nmodel examples.hf_models:llama_causal_lm()\n"
                      "input input_ids : int64[b=4, s=8] in [0, 256)\ninput labels : int64[b=2, s] in [0, 256)\n",
     [("E006", 4, 22)]),
    ("dim-example-of-one", "mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[batch=1, 256]\n",
     [("E007", 3, 19)]),
    ("shapes-do-not-fit", "mesh tp = 2\nmodel examples.models:MLP(d_model=16)\ninput x : float32[4, 15]\n", [("E035", 3, 1)]),
    ("unknown-name", layout("fc3.weight : S(0)"), [("E040", 5, 3)]),
    ("wildcard-matches-nothing", layout("*.gamma : B"), [("E040", 5, 3)]),
    ("unknown-output-part", layout("output.logits : B"), [("E040", 5, 3)]),
    ("two-layouts", layout("fc1.weight : S(0)", "*.weight : B"), [("E043", 6, 3)]),
    ("too-many-axis-values", layout("x : [B, B]"), [("E050", 5, 7)]),
    ("bare-on-2d-mesh", layout("x : B", head=MESH2), [("E050", 5, 7)]),
    ("unknown-axis", layout("x : S(0) @ pp", head=MESH2), [("E051", 5, 14)]),
    ("axis-named-twice", layout("fc1.weight : S(0) @ tp, S(1) @ tp", head=MESH2), [("E052", 5, 34)]),
    ("split-out-of-range", layout("fc1.weight : S(2)"), [("E053", 5, 16)]),
    ("split-negative-out-of-range", layout("fc1.bias : S(-2)"), [("E053", 5, 14)]),
    ("not-divisible", "mesh tp = 3\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
                      "layout {\n  fc1.weight : S(0)\n}\n", [("E054", 5, 16)]),
    ("not-divisible-by-product", layout("x : S(0) @ dp, S(0) @ tp", head=MESH2.replace("[4, 16]", "[6, 16]")),
     [("E054", 5, 18)]),
    ("partial-parameter", layout("fc1.weight : P"), [("E055", 5, 16)]),
    ("partial-input", layout("x : P"), [("E055", 5, 7)]),
    ("partial-on-axis-of-input", layout("x : [B, P]", head=MESH2), [("E055", 5, 11)]),
    ("zigzag-on-two-axes", layout("x : S(0, zigzag) @ dp, S(0) @ tp", head=MESH2.replace("[4, 16]", "[8, 16]")),
     [("E056", 5, 26)]),
    ("zigzag-parameter", layout("fc1.weight : S(0, zigzag)"), [("E058", 5, 16)]),
    ("zigzag-takes-no-count", layout("x : S(0, zigzag=2)"), [("E001", 5, 18)]),
    ("unsupported-op", "mesh tp = 2\nmodel tests.test_errors:Unsupported()\ninput x : float32[4, 8]\n", [("E060", 2, 1)]),
    ("data-dependent-shape", "mesh tp = 2\nmodel tests.test_errors:BooleanMask()\ninput x : float32[4, 8]\n",
     [("E061", 2, 1)]),
    ("module-called-twice", "mesh tp = 2\nmodel tests.test_errors:Twice()\ninput x : float32[4, 8]\n"
                            "layout {\n  lin() : B\n}\n", [("E044", 5, 3)]),
    ("numpy-random", "mesh tp = 2\nmodel tests.test_errors:DrawsWithNumPy()\ninput x : float32[4, 8]\n",
     [("E063", 2, 1)]),
]


class Unsupported(__import__("torch").nn.Module):
    def forward(self, x):  # the fused attention draws its dropout per rank's heads inside the kernel
        return __import__("torch").nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.5)


class DrawsWithNumPy(__import__("torch").nn.Module):
    def forward(self, x):  # a mask drawn outside torch, as Wav2Vec2's SpecAugment draws it: a trace fixes it
        import numpy
        import torch
        return x * torch.tensor(numpy.random.rand(x.shape[0]) > 0.5, device=x.device)[:, None]


class BooleanMask(__import__("torch").nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


class Centred(__import__("torch").nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = __import__("torch").nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x - x.mean(-1, keepdim=True))


class LoopedExperts(torch.nn.Module):
    """DBRX's experts: a loop over each expert's tokens, found with nonzero(), skipping an expert with none."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x, chosen):
        out = torch.zeros_like(x)
        for index in range(len(self.weights)):
            tokens = torch.nonzero(chosen == index).squeeze(-1)
            if tokens.shape[0] == 0:
                continue
            out = out.index_add(0, tokens, x[tokens] @ self.weights[index])
        return out


class MixtureOfExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(16, 4)
        self.experts = LoopedExperts()

    def forward(self, x):
        return self.experts(x, self.router(x).argmax(-1))


class Twice(__import__("torch").nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = __import__("torch").nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.lin(x))


@pytest.mark.parametrize("text, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_code_line_and_column(compile_par, text, expected):
    with pytest.raises(CompileError) as caught:
        compile_par(text)
    got = [(d.code, d.span.line, d.span.column) for d in caught.value.diagnostics]
    assert got == expected, caught.value.render()


def test_at_least_25_distinct_cases_and_codes():
    assert len(CASES) >= 25
    codes = {code for _, _, expected in CASES for code, _, _ in expected}
    assert len(codes) >= 25
    assert codes <= set(ERROR_CODES)


def test_several_errors_in_one_run(compile_par):
    text = layout("x : P", "fc1.weight : S(2)", "fc3.weight : S(1)", "fc2.weight : [S(0), B]")
    with pytest.raises(CompileError) as caught:
        compile_par(text)
    assert [(d.code, d.span.line) for d in caught.value.diagnostics] == [
        ("E055", 5), ("E053", 6), ("E040", 7), ("E050", 8)]


def test_rendered_diagnostic_has_file_line_column_source_and_caret(compile_par, tmp_path):
    with pytest.raises(CompileError) as caught:
        compile_par(layout("fc1.weight : S(2)"), name="bad.par")
    rendered = caught.value.render()
    assert f"{tmp_path / 'bad.par'}:5:16: error[E053]: S(2) is out of range for `fc1.weight` of rank 2" in rendered
    assert "   5 |   fc1.weight : S(2)\n     |                ^^^^" in rendered


def test_unknown_name_suggests_the_closest(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par(layout("fc1.wieght : S(0)"))
    assert caught.value.diagnostics[0].notes[0].startswith("did you mean `fc1.weight`")


DEEP = "mesh tp = 2\nmodel examples.models:DeepMLP(depth=5, d_model=8, d_ff=16)\ninput x : float32[4, 8]\n"


def test_an_unknown_pattern_is_offered_the_pattern_it_meant(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par(layout("blocks.*.fc1.wieght : S(0)", head=DEEP))
    assert caught.value.diagnostics[0].notes[0].startswith("did you mean `blocks.*.fc1.weight`")


def test_a_line_naming_several_tensors_reports_its_mistake_once(compile_par):
    # one line, five tensors with the same mistake: one error at the line, naming the others in a note
    with pytest.raises(CompileError) as caught:
        compile_par(layout("blocks.*.fc1.weight : S(2)", "blocks.*.fc2.bias : S(0)", head=DEEP))
    (error,) = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E053", 5, 25)
    assert "`blocks.0.fc1.weight`" in error.message
    assert error.notes == ("also for `blocks.1.fc1.weight`, `blocks.2.fc1.weight`, `blocks.3.fc1.weight` and 1 more",)


@pytest.mark.parametrize("text, code", [(CASES[0][1], "E001"), (layout("x : P"), "E055"),
                                        ("mesh tp = 2\nmodel no_such_module:MLP()\n", "E020"),
                                        # torch logs the failing trace's traceback itself; it must not show
                                        ({case[0]: case[1] for case in CASES}["shapes-do-not-fit"], "E035")])
def test_cli_reports_without_traceback_and_exits_1(tmp_path, text, code):
    path = tmp_path / "bad.par"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "check", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert f"error[{code}]" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_usage_errors_exit_2(tmp_path):
    for argv in (["check"], ["frobnicate"], ["check", str(tmp_path / "missing.par")],
                 ["run", "examples/mlp.par", "--nproc", "two"]):
        result = subprocess.run([sys.executable, "-m", "pardsl.cli", *argv], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, argv
        assert "Traceback" not in result.stderr


def test_run_with_the_wrong_world_size_is_E012(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", "examples/mlp.par", "--nproc", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "examples/mlp.par:2:1: error[E012]: the mesh (tp = 2) has 2 ranks but --nproc is 3" in result.stderr


@torch.library.custom_op("pardsl_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return x.new_empty(x.shape)


class NotATen(torch.nn.Module):
    def forward(self, x):
        return _twice(x)


def test_an_op_outside_aten_is_named_by_its_namespace(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 2\nmodel tests.test_errors:NotATen()\ninput x : float32[4, 8]\n")
    [error] = caught.value.diagnostics
    assert error.code == "E060" and "`pardsl_test.twice.default`" in error.message




def test_a_module_not_found_says_where_it_looked_and_how_to_import_it(compile_par, tmp_path):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 2\nmodel no_such_module:MLP()\n")
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E020", 2, 1)
    looked, how = error.notes[1:]
    assert f"looked in `{tmp_path}` (the .par file's folder)" in looked and "PYTHONPATH" in looked
    assert "`no_such_module.py`" in how and "pip install -e ." in how and "PYTHONPATH" in how


@pytest.mark.parametrize("model", ["tests.test_errors:Centred()",  # int64 reaches mean(): the trace fails
                                   "examples.models:MLP(d_model=16)"])  # int64 reaches linear: a run fails
def test_an_integer_input_to_a_float_model_is_told_the_dtype_that_works(compile_par, model):
    with pytest.raises(CompileError) as caught:
        compile_par(f"mesh tp = 2\nmodel {model}\ninput x : int64[4, 16] in [0, 10)\n")
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E038", 3, 11)
    assert error.message.startswith("input `x` is int64") and error.message.endswith("float32")
    assert error.notes[0] == "declare it `x : float32[4, 16]`"


def test_an_indivisible_size_is_told_the_sizes_and_axis_sizes_that_divide(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 3\nmodel examples.models:MLP(d_model=16, d_ff=1000)\ninput x : float32[4, 16]\n"
                    "layout {\n  fc1.weight : S(0)\n}\n")
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E054", 5, 16)
    assert error.notes[1:] == ("1000 is not divisible by 3; 999 or 1002 would be", "tp = 2, 4, 5 or 8 would divide 1000")


def test_an_error_every_shape_of_a_searched_mesh_makes_is_told_once_at_its_line(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par(layout("fc3.weight : S(0) @ tp", head=MLP.replace("mesh tp = 2", "mesh dp, tp = 4")))
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E040", 5, 3)
    assert error.notes[-1] == "every shape of the mesh (dp, tp = 4) failed the same way"


def test_experts_looping_over_nonzero_are_told_where_with_the_mixture_of_experts_hint(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 2\nmodel tests.test_errors:MixtureOfExperts()\ninput x : float32[8, 16]\n")
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E061", 2, 1)
    assert "depends on the data" in error.message
    assert error.notes[0] == "used in experts"
    assert error.notes[1].startswith("at tests/test_errors.py:") and error.notes[1].endswith("if tokens.shape[0] == 0:")
    assert any("pardsl.model.moe.use_static_capacity" in note for note in error.notes)
