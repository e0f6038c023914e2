import pytest

from pardsl.language.diagnostics import CompileError
from pardsl.language.syntax import parse

MLP_EXAMPLE = """\
# examples/mlp.par — Megatron tensor parallelism for a two-layer MLP
mesh   tp = 2
model  examples.models:MLP(d_model=256, d_ff=1024)   # "module:callable(literal kwargs)" → nn.Module
input  x : float32[16, 256]                           # example inputs, in forward() order
                                                      # integers carry a range: input ids : int64[4, 32] in [0, 1024)

layout {
    x            : B
    fc1.weight   : S(0)          # column parallel
    fc1.bias     : S(0)
    fc2.weight   : S(1)          # row parallel
    output       : B
}
"""


def test_design_example_parses_with_spans():
    par = parse(MLP_EXAMPLE, "mlp.par")
    assert [(a.name, a.size) for a in par.mesh.axes] == [("tp", 2)]
    assert (par.model.module, par.model.factory, par.model.kwargs) == (
        "examples.models", "MLP", (("d_model", 256), ("d_ff", 1024)))
    assert [(i.name, i.dtype, i.shape) for i in par.inputs] == [("x", "float32", (16, 256))]
    assert [(e.target, e.layout.placements[0].kind, e.layout.placements[0].dim) for e in par.layouts] == [
        ("x", "B", None), ("fc1.weight", "S", 0), ("fc1.bias", "S", 0), ("fc2.weight", "S", 1), ("output", "B", None)]
    weight = par.layouts[1]
    assert (weight.span.line, weight.span.column) == (9, 5)
    assert (weight.target_span.line, weight.target_span.column, weight.target_span.end_column) == (9, 5, 15)
    assert (weight.layout.span.line, weight.layout.span.column) == (9, 20)
    assert (par.model.factory_span.line, par.model.factory_span.column) == (3, 24)


def test_every_v1_form():
    par = parse("""mesh dp = 2, tp = 4
model pkg.mod:make(n=3, name="gpt", ratio=-0.5, flags=[True, False], shape=(2, 3), extra=None)
input ids : int64[4, 32] in [0, 1024)
input mask : bool[4, 32]
layout {
  blocks.*.mlp.fc1.weight : [S(0), B]
  ids : S(0) @ dp
  emb.weight : S(0) @ tp, S(1) @ dp
  output.logits : [B, S(-1)]
  output[0] : [P, B]
  blocks.3.attn() : [B, B]
  blocks.3.attn()[0] : [B, B]
}
""")
    assert par.model.kwargs == (("n", 3), ("name", "gpt"), ("ratio", -0.5), ("flags", [True, False]),
                                ("shape", (2, 3)), ("extra", None))
    assert par.inputs[0].value_range == (0, 1024) and par.inputs[1].value_range is None
    forms = [(e.target, e.layout.form) for e in par.layouts]
    assert forms == [("blocks.*.mlp.fc1.weight", "list"), ("ids", "named"), ("emb.weight", "named"),
                     ("output.logits", "list"), ("output[0]", "list"), ("blocks.3.attn()", "list"),
                     ("blocks.3.attn()[0]", "list")]
    assert [a for a, _ in par.layouts[2].layout.axis_names] == ["tp", "dp"]
    assert par.layouts[3].layout.placements[1].dim == -1


def test_model_arguments_nest_lists_tuples_and_string_keyed_dicts():
    # a config's nested settings (rope_parameters={...}); `None` written inside a bracket is a value
    par = parse('mesh tp = 2\nmodel m:f(rope={"full": {"type": "default", "theta": 1e4}}, kinds=[None], '
                'pair=(None,), none=[], empty={}, unit=(), mixed=[{"a": [1, (2,)]}],)\n')
    assert par.model.kwargs == (("rope", {"full": {"type": "default", "theta": 1e4}}), ("kinds", [None]),
                                ("pair", (None,)), ("none", []), ("empty", {}), ("unit", ()),
                                ("mixed", [{"a": [1, (2,)]}]))


def test_a_keyword_argument_given_twice_is_refused_where_it_is_given_again():
    # Python refuses `f(a=1, a=3)`; read into a dict, the second would silently win
    with pytest.raises(CompileError) as error:
        parse("mesh tp = 2\nmodel m:f(a=1, b=2, a=3)\n")
    diagnostic = error.value.diagnostics[0]
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.column) == ("E003", 2, 21)
    assert diagnostic.message == "keyword argument `a` given twice"
    assert diagnostic.notes == ("first given at column 11; keep one",)


def test_a_dict_key_must_be_a_string():
    with pytest.raises(CompileError) as error:
        parse("mesh tp = 2\nmodel m:f(settings={full: 1})\n")
    diagnostic = error.value.diagnostics[0]
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.column) == ("E001", 2, 21)
    assert diagnostic.message == "unexpected 'full'" and "a string" in diagnostic.notes[0]


def test_model_without_arguments_and_no_trailing_newline():
    par = parse("mesh tp = 1\nmodel m:f\nlayout {\n}")
    assert par.model.kwargs == () and par.layouts == ()


def test_comments_and_blank_lines_anywhere():
    par = parse("# head\n\n  # indented\nmesh tp = 2 # tail\n\n# between\nmodel m:f()\nlayout {\n\n # c\n x : B # c\n\n}\n")
    assert [e.target for e in par.layouts] == ["x"]


def _errors(text):
    with pytest.raises(CompileError) as caught:
        parse(text, "f.par")
    return [(d.code, d.span.line, d.span.column) for d in caught.value.diagnostics]


def test_several_syntax_errors_each_on_its_own_line():
    text = "mesh tp = \nmodel a:b(\ninput x : float32[4, 8\nlayout {\n  w : Q\n  v : S(x)\n  ok : B\n}\n"
    assert _errors(text) == [("E001", 1, 11), ("E001", 2, 11), ("E001", 3, 23), ("E001", 5, 7), ("E001", 6, 9)]


def test_unexpected_character_and_end_of_file():
    assert _errors("mesh tp = 2 $\nmodel m:f\n") == [("E002", 1, 13)]
    assert _errors("mesh tp = 2\nmodel m:f\nlayout {\n  w : S(0)\n") == [("E001", 4, 11)]


def test_syntax_error_message_says_what_was_expected():
    with pytest.raises(CompileError) as caught:
        parse("mesh tp = 2\nmodel m:f\nlayout {\n  w : Q\n}\n", "f.par")
    rendered = caught.value.render()
    assert "f.par:4:7: error[E001]: unexpected 'Q'" in rendered
    assert "expected '?', 'B', 'P', 'S', '['" in rendered
    assert "   4 |   w : Q\n     |       ^" in rendered
