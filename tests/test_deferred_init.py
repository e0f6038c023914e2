"""Initial values without the whole model (pardsl/model/deferred_init.py): each parameter made from a record
of the factory run on the meta device equals the serial model's bit for bit, the generator ends where
serial's build leaves it, and making them holds one whole tensor at a time."""

import functools

import pytest
import torch

from examples.hf_models import HFLlama, gpt2_lm_head
from examples.language_models import Llama
from examples.models import DeepMLP
from pardsl.model.deferred_init import InitialValues, generator_kept, record
from pardsl.tools.memory import peak_measured


class InitialisedEveryWay(torch.nn.Module):
    """Initialisers that read other tensors, write through views, and tie weights."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embedding.weight  # tied
        self.square = torch.nn.Parameter(torch.empty(8, 8))
        torch.nn.init.orthogonal_(self.square)  # a QR of a random draw, copied in
        self.truncated = torch.nn.Parameter(torch.empty(4, 8))
        torch.nn.init.trunc_normal_(self.truncated, std=0.02)
        self.drawn = torch.nn.Parameter(torch.randn(3, 5) * 0.1 + 1)  # a factory's draw, scaled out of place
        self.given = torch.nn.Parameter(torch.tensor([0.5, 2.0]))  # from Python data: real, not meta
        with torch.no_grad():
            self.embedding.weight[3].fill_(2.0)  # through a view
            self.square[:, 0].mul_(self.drawn[0, :1])  # reading another parameter


FACTORIES = {
    "LLaMA-style": functools.partial(Llama, vocab_size=256, n_layer=2, n_head=8, n_kv_head=4, d_model=64, d_ff=128),
    "Hugging Face LLaMA": functools.partial(HFLlama, layers=2),
    "Hugging Face GPT-2": functools.partial(gpt2_lm_head, layers=2),
    "initialisers of every kind": InitialisedEveryWay,
}


@pytest.mark.parametrize("name", FACTORIES)
def test_every_parameter_made_from_the_record_is_serials(name):
    factory = FACTORIES[name]
    torch.manual_seed(7)
    serial = factory()
    after_serial = torch.get_rng_state()
    torch.manual_seed(7)
    made = record(factory)
    assert torch.equal(torch.get_rng_state(), after_serial)  # the seed goes on as serial's build left it
    values = InitialValues(made, {})
    for (serial_name, expected), (made_name, meta) in zip(serial.named_parameters(remove_duplicate=False),
                                                          made.model.named_parameters(remove_duplicate=False)):
        assert serial_name == made_name
        assert meta.device.type == ("cpu" if made_name == "given" else "meta")
        assert torch.equal(values[made_name], expected.detach()), name
    assert torch.equal(torch.get_rng_state(), after_serial)


def test_making_the_values_holds_one_whole_tensor_at_a_time():
    factory = functools.partial(DeepMLP, depth=16, d_model=128, d_ff=512)
    torch.manual_seed(0)
    largest = max(p.numel() * p.element_size() for p in factory().parameters())
    whole = sum(p.numel() * p.element_size() for p in factory().parameters())
    with peak_measured(torch.device("cpu"), 0) as peak:
        made = record(factory)
        with generator_kept():
            for _, meta in made.model.named_parameters():
                value = made.value(meta.detach())
                del value
    assert peak[0] <= 2 * largest < whole / 8, (peak, largest, whole)


class NeedsValuesToBuild(torch.nn.Module):
    def __init__(self):
        super().__init__()
        rates = torch.linspace(0, 0.1, 4)
        self.rate = rates[-1].item()  # data the factory reads while it builds: not on meta
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * self.rate


def test_a_factory_that_reads_values_while_it_builds_cannot_be_recorded():
    with pytest.raises(Exception):
        record(NeedsValuesToBuild)


@pytest.mark.parametrize("model", ["examples.hf_models:HFLlama(layers=1)", "tests.test_deferred_init:NeedsValuesToBuild()"])
def test_plan_module_gives_serials_values_whether_or_not_the_factory_runs_on_meta(tmp_path, model):
    """Through the API: the recorded factory's values, or, where the factory reads values while it builds,
    the serial model's built whole; either way serial's, and the seed goes on as after serial's build."""
    import pardsl

    inputs = "input input_ids : int64[2, 8] in [0, 256)" if "HFLlama" in model else "input x : float32[2, 4]"
    path = tmp_path / "plan.par"
    path.write_text(f"mesh tp = 1\nmodel {model}\n{inputs}\n")
    plan = pardsl.load(str(path))
    torch.manual_seed(3)
    module = plan.module()
    after = torch.get_rng_state()
    factory = HFLlama if "HFLlama" in model else NeedsValuesToBuild
    torch.manual_seed(3)
    serial = factory(layers=1) if factory is HFLlama else factory()
    assert torch.equal(after, torch.get_rng_state())
    shards = {name: local for name, local, _ in module.named_shards()}
    for name, expected in serial.named_parameters():
        assert torch.equal(shards[name], expected.detach()), name
