"""``megatron-siamese eval``: lm-evaluation-harness runs an exported SiameseNorm model (its
remote-code modeling file) offline on our addition task, and what it reports is the Megatron
model's own log-likelihoods and greedy decodes (docs/evaluate.md). Skipped without the [hf]
extra (lm-eval, transformers)."""

import json
import os

import pytest

for _name, _value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}.items():
    os.environ.setdefault(_name, _value)  # before anything imports huggingface_hub: no network here

pytest.importorskip("lm_eval", reason="the [hf] extra (lm-eval) is not installed")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from megatron_siamese.cli import main  # noqa: E402
from megatron_siamese.evaluation.addition_task import write_addition_tasks, write_task  # noqa: E402
from megatron_siamese.evaluation.harness import EvalPlan, evaluate  # noqa: E402


@pytest.fixture(scope="module")
def exported(megatron_module_rank, tmp_path_factory):
    """(a tiny SiameseNorm GPTModel, its exported Transformers directory: remote code, byte tokenizer)."""
    from megatron_siamese.check.case import ModelCase
    from megatron_siamese.check.step import build_seeded_chunks
    from megatron_siamese.hf.export import write_directory
    from megatron_siamese.runtime.gpt import transformer_config
    from megatron_siamese.runtime.layout import Layout

    case = ModelCase(norm="siamese", normalization="RMSNorm", add_bias_linear=False, vocab_size=320, seq_length=32)
    (model,) = build_seeded_chunks(case, transformer_config(case, Layout()))
    with torch.no_grad():  # greedy decodes stay ASCII text (seeded weights would pick any of the 320 ids)
        model.embedding.word_embeddings.weight[128:] = 0
        if not model.share_embeddings_and_output_weights:
            model.output_layer.weight[128:] = 0
    directory = str(tmp_path_factory.mktemp("hf"))
    write_directory(model.eval(), case.norm, directory)
    return model, directory


@pytest.fixture(scope="module")
def model_dir(exported):
    return exported[1]


@pytest.fixture(scope="module")
def model(exported):
    return exported[0]


def logits(model, ids):
    """The Megatron model's logits for one sequence of token ids."""
    s = len(ids)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    return model(torch.tensor([ids]), torch.arange(s)[None], causal)[0]


@torch.no_grad()
def direct(model, context: str, continuation: str):
    """(log-likelihood of ``continuation`` after ``context``, whether greedy decoding yields it),
    straight from the Megatron model's logits: token ids are the UTF-8 bytes."""
    ids = list((context + continuation).encode())
    n = len(continuation.encode())
    logprobs = logits(model, ids)[:-1].float().log_softmax(-1)[-n:]
    targets = torch.tensor(ids[-n:])
    return logprobs.gather(1, targets[:, None]).sum().item(), bool((logprobs.argmax(-1) == targets).all())


@torch.no_grad()
def greedy(model, context: str, steps: int) -> str:
    ids = list(context.encode())
    for _ in range(steps):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return bytes(i for i in ids[len(context.encode()):] if i < 256).decode("latin-1")


def test_the_harness_scores_the_models_own_log_likelihoods(model_dir, model, tmp_path):
    # four held-out addition problems; and four requests whose continuation is the model's own
    # greedy decode (every 'acc' 1) or that decode with its last token changed (0)
    problems = [(context, target) for context, target in _requests(tmp_path / "ours")[:4]]
    decoded = [(context, greedy(model, context, 3)) for context, _ in problems]
    mixed = [decoded[0], decoded[1], (decoded[2][0], decoded[2][1][:-1] + _other(decoded[2][1][-1])),
             (decoded[3][0], decoded[3][1][:-1] + _other(decoded[3][1][-1]))]
    write_task(str(tmp_path / "tasks"), "greedy_or_not", mixed)
    results = evaluate(EvalPlan(model_dir, tasks=["siamese_addition", "greedy_or_not"], limit=4, batch_size=3,
                                log_samples=True, task_dirs=[str(tmp_path / "tasks")]))

    for task, requests in (("siamese_addition", problems), ("greedy_or_not", mixed)):
        samples = samples_of(results, task)
        assert [tuple(s["arguments"][0]) for s in samples] == requests  # the prompt and answer as written
        got = [tuple(s["resps"][0][0]) for s in samples]
        expected = [direct(model, *request) for request in requests]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-4)
        assert [g for _, g in got] == [g for _, g in expected]
    assert [g for _, g in (tuple(s["resps"][0][0]) for s in results["samples"]["greedy_or_not"])] == [
        True, True, False, False]
    assert results["results"]["greedy_or_not"]["acc,none"] == 0.5
    assert results["results"]["siamese_addition"]["acc,none"] == pytest.approx(
        sum(direct(model, *r)[1] for r in problems) / 4)

    # the comparison catches a model other than the one evaluated: one weight changed
    weight = model.decoder.layers[1].mlp.linear_fc2.weight
    harness = samples_of(results, "siamese_addition")[0]["resps"][0][0][0]
    with torch.no_grad():
        weight[0] += 0.5
    try:
        assert direct(model, *problems[0])[0] != pytest.approx(harness, abs=1e-4)
    finally:
        with torch.no_grad():
            weight[0] -= 0.5


def samples_of(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _requests(directory):
    write_addition_tasks(str(directory))
    with open(directory / "siamese_addition.jsonl") as lines:
        return [(d["prompt"], d["answer"]) for d in map(json.loads, lines)]


def _other(character: str) -> str:
    return "7" if character != "7" else "8"


def test_the_addition_task_is_the_trainers_held_out_problems(tmp_path):
    from megatron_siamese.data.addition import split

    _, test = split(3, 1, 500, 7)  # exact_match_accuracy's problems
    requests = _requests(tmp_path)
    assert len(requests) == 500
    assert requests[:2] == [(f"\n{a}+{b}=", f"{a + b}\n") for a, b in test[:2]]
    with open(tmp_path / "siamese_addition_reversed.jsonl") as lines:
        first = json.loads(lines.readline())
    a, b = test[0]
    assert first == {"prompt": f"\n{a}+{b}=", "answer": f"{str(a + b)[::-1]}\n"}


def test_the_command_prints_the_table_and_writes_json(model_dir, model, tmp_path, capsys):
    output = tmp_path / "eval"
    assert main(["eval", "--hf", model_dir, "--limit", "3", "--output-dir", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "|siamese_addition|" in printed and "|acc       |" in printed
    assert printed.startswith(f"eval: siamese_addition on {model_dir}, 3 problems a task (3-digit held-out addition")
    saved = json.loads((output / "results.json").read_text())
    # the share of the first three problems whose answer the Megatron model decodes greedily
    first_three = _requests(tmp_path / "tasks")[:3]
    expected = sum(direct(model, *request)[1] for request in first_three) / 3
    assert saved["results"]["siamese_addition"]["acc,none"] == pytest.approx(expected)
    # the table's acc row shows the same share (lm-eval rounds it to 3 or 4 places by release)
    acc_row = next(line for line in printed.splitlines() if "|acc " in line)
    shown = acc_row.replace(" ", "").split("|")[7]
    assert float(shown) == pytest.approx(expected, abs=0.5 * 10 ** -len(shown.split(".")[1]))
    assert saved["configs"]["siamese_addition"]["output_type"] == "loglikelihood"
    # a second run does not replace it unasked
    assert main(["eval", "--hf", model_dir, "--output-dir", str(output)]) == 2
    assert "results.json exists: choose another --output-dir or pass --overwrite" in capsys.readouterr().err


def test_a_checkpoint_is_exported_then_evaluated(model_dir, tmp_path, capsys):
    # the exported directory imported as a checkpoint: evaluating the checkpoint (--load exports it
    # again) reports what evaluating the directory does
    from megatron_siamese.hf.export import import_hf

    checkpoint = import_hf(model_dir, str(tmp_path / "imported"))
    scores = {}
    for source in (["--hf", model_dir], ["--load", checkpoint]):
        output = tmp_path / source[0].strip("-")
        assert main(["eval", *source, "--limit", "6", "--output-dir", str(output)]) == 0
        scores[source[0]] = json.loads((output / "results.json").read_text())["results"]["siamese_addition"]
    assert "exported" in capsys.readouterr().out
    assert scores["--load"]["perplexity,none"] == pytest.approx(scores["--hf"]["perplexity,none"], rel=1e-5)
    assert scores["--load"]["acc,none"] == scores["--hf"]["acc,none"]
    assert main(["eval", "--load", str(tmp_path / "none"), "--output-dir", str(tmp_path / "x")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_refusals_are_one_line(model_dir, tmp_path, capsys, monkeypatch):
    assert main(["eval", "--hf", str(tmp_path), "--output-dir", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip().endswith("no config.json there; give a Transformers model directory "
                                                    "(megatron-siamese export writes one)")
    import torch

    if not torch.cuda.is_available():  # said before the harness loads the model (it failed there)
        assert main(["eval", "--hf", model_dir, "--device", "cuda:0", "--output-dir", str(tmp_path / "b")]) == 2
        assert capsys.readouterr().err.strip().endswith("--device cuda:0: no CUDA GPU here "
                                                        f"(torch {torch.__version__}); use --device cpu")
    assert main(["eval", "--hf", model_dir, "--device", "gpu", "--output-dir", str(tmp_path / "b")]) == 2
    assert "--device gpu: Expected one of cpu, cuda" in capsys.readouterr().err
    assert main(["eval", "--hf", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--hf {tmp_path / 'nowhere'} does not exist: give a Transformers "
                                                    "model directory (megatron-siamese export writes one)")
    # (an unknown --tasks name is refused too, after indexing the harness's own tasks: 40 s, not tested)
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # the extra not installed
    assert main(["eval", "--hf", model_dir, "--output-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'megatron_siamese[hf]'" in err
