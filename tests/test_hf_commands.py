"""``megatron-siamese export`` and ``import-hf`` on checkpoints saved under TP/PP layouts.

Three checkpoints are saved once for the module, each by a job at its layout with every weight
seeded from its global name (check/sharding.py: the same values whatever the layout):
RMSNorm at TP1, the hybrid variant (RMSNorm) at TP2, LayerNorm with biases at TP2 x PP2 (tied
embeddings split over the first and last stage). Each is exported (the last by the CLI) and the
exported model's logits equal the one-rank Megatron model's with those weights (fp32, 1e-5
relative). ``import-hf`` (CLI) turns an export back into a checkpoint whose weights, loaded
through the model session, are bit-identical to the original; so does the Pre-Norm -> Llama
route. Bad input is refused in one line with nothing written.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from megatron_siamese.check.case import ModelCase  # noqa: E402
from megatron_siamese.hf.export import (VERIFY_RTOL, export, import_hf, load_exported, read_hf_config,  # noqa: E402
                                         verify, write_directory)
from megatron_siamese.runtime.layout import Layout  # noqa: E402
from megatron_siamese.runtime.launch import run_job  # noqa: E402

VOCAB = 320
RTOL = 1e-5
SAVED = {  # name: (model, layout)
    "tp1-rmsnorm": (ModelCase(normalization="RMSNorm", add_bias_linear=False, vocab_size=VOCAB), Layout()),
    "tp2-hybrid-rmsnorm": (ModelCase(norm="siamese-hybrid", normalization="RMSNorm", vocab_size=VOCAB), Layout(tp=2)),
    "tp2pp2-layernorm": (ModelCase(vocab_size=VOCAB), Layout(tp=2, pp=2)),
}
CLI = [sys.executable, "-m", "megatron_siamese.cli"]


def train_args(case: ModelCase, layout: Layout, output_dir: str):
    """The TrainArgs a checkpoint of ``case`` at ``layout`` records (the session reads the model from them)."""
    from megatron_siamese.runtime.settings import ModelSettings
    from megatron_siamese.training.args import TrainArgs

    from megatron_siamese.runtime.settings import MLA_SETTINGS

    model = {f.name: getattr(case, f.name) for f in dataclasses.fields(ModelSettings)}
    model.update(moe_layer_freq="1", moe_z_loss_coeff=None)  # the check's MoE defaults; these cases are dense
    if not case.multi_latent_attention:  # nor the check's MLA sizes: the settings refuse them without MLA
        model.update({name: ModelSettings.__dataclass_fields__[name].default for name in MLA_SETTINGS})
    return TrainArgs(**model, tp=layout.tp, pp=layout.pp, dp=1, output_dir=output_dir,
                     micro_batch_size=1, global_batch_size=1)


def _save_seeded(case: ModelCase, layout: Layout, directory: str) -> str:
    """On each rank of a job at ``layout``: the case's seeded model chunks, saved model-only."""
    from megatron.core import parallel_state

    from megatron_siamese.check.sharding import seed_parameters
    from megatron_siamese.models import build_model_chunks
    from megatron_siamese.runtime.gpt import initialize_model_parallel, transformer_config
    from megatron_siamese.training import checkpoint

    initialize_model_parallel(layout, case.seed)
    try:
        chunks = build_model_chunks(transformer_config(case, layout), case, VOCAB)
        seed_parameters(chunks, case.seed, parallel_state.get_tensor_model_parallel_rank(), layout.tp,
                        case.zero_centered_gamma)
        return checkpoint.save_model(chunks, train_args(case, layout, directory), os.path.join(directory, "checkpoints"),
                                     vocab_size=VOCAB)
    finally:
        parallel_state.destroy_model_parallel()


def _save_and_export(saves, exports):
    """On each rank of one job (cheaper than a job per layout): every checkpoint of ``saves``
    (case, layout, directory) saved on the job's first ranks, then ``exports`` (checkpoints,
    output directory) exported on its first rank, as ``export`` does on its own rank."""
    from megatron_siamese.hf.export import _export_rank, written_atomically
    from megatron_siamese.runtime.job import on_first_ranks

    for case, layout, directory in saves:
        on_first_ranks(layout.world_size, _save_seeded, case, layout, directory)

    def export_all():
        for checkpoints, output in exports:
            with written_atomically(output) as tmp:
                _export_rank(checkpoints, None, tmp)

    on_first_ranks(1, export_all)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (case, checkpoints directory, exported directory)}; the TP2 x PP2 one exported by the CLI."""
    out = {name: (case, str(tmp_path_factory.mktemp(name))) for name, (case, _) in SAVED.items()}
    out = {name: (case, os.path.join(directory, "checkpoints"), os.path.join(directory, "hf"))
           for name, (case, directory) in out.items()}
    saves = [(case, SAVED[name][1], os.path.dirname(checkpoints)) for name, (case, checkpoints, _) in out.items()]
    cli = "tp2pp2-layernorm"
    exports = [(checkpoints, exported) for name, (_, checkpoints, exported) in out.items() if name != cli]
    run_job(_save_and_export, max(layout.world_size for _, layout in SAVED.values()), saves, exports)
    _, checkpoints, exported = out[cli]
    done = subprocess.run(CLI + ["export", "--load", checkpoints, "--output-dir", exported], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    # what it wrote, as its config says, and how close the verification came
    from transformers import AutoTokenizer

    case, config, tokens = SAVED[cli][0], read_hf_config(exported), len(AutoTokenizer.from_pretrained(exported))
    said = re.search(rf"^exported iteration (\d+) of {re.escape(checkpoints)}/iter_\d+: --norm {case.norm}, "
                     rf"{case.num_layers} layers, hidden {case.hidden_size}, {tokens} byte-level tokens in "
                     rf"{config['vocab_size']} embedding rows, "
                     r"SiameseNormForCausalLM; its logits are the checkpoint's to (\S+) of their magnitude$",
                     done.stdout, re.M)
    assert said and float(said.group(2)) <= VERIFY_RTOL, done.stdout
    assert f"Hugging Face model: {exported} (AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))" \
        in done.stdout
    return out


def one_rank_model(case):
    from megatron_siamese.check.step import build_seeded_chunks
    from megatron_siamese.runtime.gpt import transformer_config

    (model,) = build_seeded_chunks(case, transformer_config(case, Layout()))
    return model.eval()


@pytest.mark.parametrize("name", sorted(SAVED))
def test_export_of_a_layout_computes_the_megatron_model(megatron_single_rank, saved, name):
    case, _, exported = saved[name]
    model = one_rank_model(case)
    ids = torch.randint(0, 258, (2, case.seq_length), generator=torch.Generator().manual_seed(1))
    causal = torch.ones(case.seq_length, case.seq_length, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        expected = model(ids, torch.arange(case.seq_length).expand_as(ids), causal)
        actual = load_exported(exported)(ids).logits
    assert float((actual - expected).abs().max() / expected.abs().max()) < RTOL
    assert sorted(os.listdir(exported)) == sorted([
        "config.json", "generation_config.json", "megatron_siamese.json", "model.safetensors", "modeling_siamese.py",
        "tokenizer.json", "tokenizer_config.json"])


def _full_state(checkpoint: str):
    from saved_models import load_full_model

    return {k: v for k, v in load_full_model(checkpoint).state_dict.items() if not k.endswith("_extra_state")}


def test_import_hf_round_trips_bit_for_bit(megatron_single_rank, saved, tmp_path):
    case, checkpoints, exported = saved["tp2pp2-layernorm"]
    output = str(tmp_path / "imported")
    done = subprocess.run(CLI + ["import-hf", "--hf", exported, "--output-dir", output], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    original = {k: v for k, v in one_rank_model(case).state_dict().items() if not k.endswith("_extra_state")}
    imported = _full_state(os.path.join(output, "checkpoints"))
    assert imported.keys() == original.keys()
    assert all(torch.equal(imported[k], original[k]) for k in original)


def test_pre_norm_round_trips_through_llama(megatron_single_rank, tmp_path):
    case = ModelCase(norm="pre", normalization="RMSNorm", add_bias_linear=False, vocab_size=VOCAB)
    model = one_rank_model(case)
    exported = str(tmp_path / "llama")
    os.makedirs(exported)
    write_directory(model, "pre", exported)
    # export's own check of a Llama: Transformers' model, not remote code, so nothing of its cache is removed
    # (an export of --norm pre once removed site-packages/transformers/models, the Llama module's folders up)
    import transformers.models.llama.modeling_llama as llama

    assert verify(model, exported) < 1e-4
    assert os.path.isfile(llama.__file__)
    import_hf(exported, str(tmp_path / "imported"))
    imported = _full_state(str(tmp_path / "imported" / "checkpoints"))
    original = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert imported.keys() == original.keys()
    assert all(torch.equal(imported[k], original[k]) for k in original)


@pytest.mark.stack_independent
@pytest.mark.parametrize("command", ["export", "import-hf"])
def test_an_existing_output_directory_is_refused_in_one_line(saved, tmp_path, capsys, command):
    from megatron_siamese.cli import main

    _, checkpoints, exported = saved["tp1-rmsnorm"]
    source = ["--load", checkpoints] if command == "export" else ["--hf", exported]
    assert main([command, *source, "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"megatron-siamese {command}: error: --output-dir {tmp_path} exists: choose a new directory (nothing is "
        "overwritten)"]
    assert os.listdir(tmp_path) == []


def test_bad_input_is_refused_before_anything_is_written(saved, tmp_path, monkeypatch):
    import importlib.util

    from megatron_siamese.hf import export as export_module
    from megatron_siamese.hf.architecture import ExportError
    from megatron_siamese.runtime.settings import ModelSettings

    _, checkpoints, exported = saved["tp1-rmsnorm"]
    assert "no export" in export_module.exportable(ModelSettings(norm="post"))
    assert "no export" in export_module.exportable(ModelSettings(norm="mixln"))
    assert "ablations" in export_module.exportable(ModelSettings(siamese_depth_scale=False))
    assert "mixture of experts" in export_module.exportable(ModelSettings(num_moe_experts=4))
    # an HF directory without our tokenizer, or not of our kind
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(exported, name), stripped / name)
    with pytest.raises(ExportError, match="no tokenizer.json"):
        import_hf(str(stripped), str(tmp_path / "out"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ExportError, match="model_type 'gpt2'"):
        import_hf(str(tmp_path / "gpt2"), str(tmp_path / "out"))
    # the optional packages missing
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ExportError, match=r"transformers not installed: pip install 'megatron_siamese\[hf\]'"):
        export(checkpoints, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["gpt2", "stripped"]


@pytest.mark.stack_independent  # settings only: refused before any rank starts
def test_mtp_and_mla_have_no_export_yet_and_say_what_to_do():
    from megatron_siamese.hf.export import exportable
    from megatron_siamese.runtime.settings import ModelSettings

    mtp = exportable(ModelSettings(mtp_num_layers=1))
    assert mtp.startswith("--mtp-num-layers (multi-token prediction) has no export yet ")
    assert "export a model trained without it" in mtp and "megatron-siamese generate" in mtp
    mla = exportable(ModelSettings(multi_latent_attention=True, q_lora_rank=16))
    assert mla.startswith("--multi-latent-attention (multi-latent attention) has no export yet ")
    assert "export a model trained without it" in mla
    deepseek_shaped = exportable(ModelSettings(multi_latent_attention=True, num_moe_experts=4, mtp_num_layers=1))
    assert [problem.split(" has no export yet")[0] for problem in deepseek_shaped.split("; ")] == [
        "--num-experts (mixture of experts)", "--multi-latent-attention (multi-latent attention)",
        "--mtp-num-layers (multi-token prediction)"]
    assert exportable(ModelSettings()) is None


@pytest.mark.stack_independent  # a config.json's fields only
def test_import_refuses_a_config_that_names_mla_or_mtp():
    """import-hf takes no model flags: a config.json that asks for MLA or MTP layers is refused by
    name, not built without them."""
    from megatron_siamese.hf.architecture import ExportError, settings_fields

    dense = dict(model_type="megatron_siamese", vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                 num_hidden_layers=2, intermediate_size=64, max_position_embeddings=32, hidden_act="silu",
                 normalization="RMSNorm", position_embedding_type="rope")
    assert settings_fields(dense, VOCAB)["num_layers"] == 2
    for field, named in (("kv_lora_rank", "kv_lora_rank: multi-latent attention has no import"),
                         ("multi_latent_attention", "multi_latent_attention: multi-latent attention has no import"),
                         ("num_nextn_predict_layers", "num_nextn_predict_layers: multi-token prediction layers have "
                                                      "no import"),
                         ("mtp_num_layers", "mtp_num_layers: multi-token prediction layers have no import")):
        with pytest.raises(ExportError, match=f"^cannot import this megatron_siamese model exactly: {named}"):
            settings_fields({**dense, field: 1}, VOCAB)


def test_exported_generate_equals_megatron_siamese_generate(saved):
    """Greedy decoding: transformers' generate() (its KV cache) on the export, and Megatron's
    inference engine (its KV cache) on the checkpoint, give the same tokens."""
    from megatron_siamese.inference.generate import generate

    _, checkpoints, exported = saved["tp2-hybrid-rmsnorm"]
    prompts = ["In the", "Gen 1:"]
    megatron = generate(checkpoints, prompts, max_new_tokens=8)
    hf = load_exported(exported)
    for prompt, expected in zip(prompts, megatron):
        ids = torch.tensor([list(prompt.encode("utf-8"))])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=8, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == expected.tokens


@pytest.mark.stack_independent
def test_a_failure_midway_leaves_nothing(tmp_path):
    from megatron_siamese.hf.export import written_atomically

    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="midway"):
        with written_atomically(str(target)) as partial:
            open(os.path.join(partial, "model.safetensors"), "w").close()
            raise RuntimeError("midway")
    assert os.listdir(tmp_path) == []
    with written_atomically(str(target)) as partial:
        open(os.path.join(partial, "config.json"), "w").close()
        os.chmod(os.path.join(partial, "config.json"), 0o600)  # as safetensors writes its file
    assert os.listdir(tmp_path) == ["out"] and os.listdir(target) == ["config.json"]
    umask = os.umask(0o022)
    os.umask(umask)
    # others may read what was written, as any new file of this user (mkdtemp made the directory 0700)
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o777 & ~umask)
    assert oct(os.stat(target / "config.json").st_mode & 0o777) == oct(0o666 & ~umask)


def test_every_load_takes_a_runs_directory(trained_run, tmp_path, corpus_cache):
    """A run's directory as scripts/run.sh leaves it (runs/<stamp>) is what a user passes to --load:
    export, generate, analyze and upcycle read its checkpoints (eval --load goes through export)."""
    from cli_runs import cli_here

    exported = cli_here("export", "--load", trained_run, "--output-dir", tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "config.json").exists()
    # ... and back, at the vocabulary Megatron-LM padded (384 at TP 1, not our 320): the same weights
    imported = cli_here("import-hf", "--hf", tmp_path / "hf", "--output-dir", tmp_path / "imported")
    assert imported.returncode == 0, imported.stderr
    from saved_models import load_full_model

    original, back = load_full_model(str(trained_run / "checkpoints")), load_full_model(str(tmp_path / "imported"))
    assert back.vocab_size == original.vocab_size == 384 and set(back.state_dict) == set(original.state_dict)
    for name, tensor in original.state_dict.items():
        assert torch.equal(back.state_dict[name], tensor), name
    generated = cli_here("generate", "--load", trained_run, "--prompt", "In the", "--max-new-tokens", "2")
    assert generated.returncode == 0 and "\nIn the" in generated.stdout, generated.stdout + generated.stderr
    # the model is the checkpoint's (Megatron-LM's args): no model flags, and another one refused by name
    analyzed = cli_here("analyze", "--load", trained_run, "--cache-dir", corpus_cache, "--output-dir",
                        tmp_path / "analysis")
    assert analyzed.returncode == 0 and "effective depth" in analyzed.stdout, analyzed.stderr
    wrong = cli_here("analyze", "--load", trained_run, "--hidden-size", "64", "--output-dir", tmp_path / "no")
    assert wrong.returncode == 2 and not (tmp_path / "no").exists(), wrong.stderr
    assert ("holds another model than the flags describe (--hidden-size 32 -> 64; checkpoint -> flags): leave those "
            "flags out (the model is the checkpoint's)") in wrong.stderr
    # upcycle reads it too, and then says it is no Pre-Norm checkpoint (the run's is SiameseNorm)
    refused = cli_here("upcycle", "--load", trained_run, "--output-dir", tmp_path / "up")
    assert refused.returncode == 2, refused.stdout + refused.stderr  # bad input, refused before a rank starts
    assert f"--load {trained_run / 'checkpoints' / 'iter_0000004'} holds a siamese model" in refused.stderr
