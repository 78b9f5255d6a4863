"""Megatron-LM's own ``tools/run_text_generation_server.py`` serves a SiameseNorm checkpoint with
our ``--spec`` (one CPU process through runtime/megatron_lm.py, listening on 127.0.0.1 only):
one PUT /api request's greedy tokens and log-probabilities are the checkpoint's own, computed
without a KV cache from its exported Transformers model, which the export checks against the
Megatron model (docs/megatron-lm.md, "Serving"). The checkpoint is trained by ``megatron-siamese
train`` (Megatron-LM's loop, megatron-core >= 0.17). Skipped unless MEGATRON_LM names a Megatron-LM
work tree of the installed release (core_v0.19.x with megatron-core 0.19.2: its script needs the
one-name fix docs/megatron-lm.md gives) and flask/flask-restful are importable."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MEGATRON_LM = os.environ.get("MEGATRON_LM", "")
SERVER = os.path.join(MEGATRON_LM, "tools", "run_text_generation_server.py")
pytestmark = pytest.mark.skipif(
    not os.path.isfile(SERVER) or importlib.util.find_spec("megatron.training") is None or importlib.util.find_spec("flask_restful") is None
    or importlib.util.find_spec("transformers") is None,
    reason="set MEGATRON_LM to a Megatron-LM work tree (core_v0.19.x, megatron-core 0.19.2) and put flask, flask-restful and the packages "
           "docs/megatron-lm.md lists on PYTHONPATH (and install the [hf] extra) to serve a checkpoint with its "
           "text generation server",
)

# the model, in the flags of `megatron-siamese train` (Megatron-LM's) and of the server alike
LAYERS, HIDDEN, HEADS, FFN, SEQ = 2, 32, 2, 128, 32
MODEL = ["--num-layers", LAYERS, "--hidden-size", HIDDEN, "--num-attention-heads", HEADS, "--ffn-hidden-size", FFN,
         "--seq-length", SEQ, "--max-position-embeddings", SEQ, "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
PROMPT = list(b"And God said")  # token ids: NullTokenizer's text is the ids, space-separated
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A SiameseNorm checkpoint (the --spec layer: --norm siamese-layer) trained for 300 steps on the
    embedded corpus (it then continued "And God said" with " the the", not one byte repeated, when
    our old loop trained it)."""
    out = str(tmp_path_factory.mktemp("run") / "checkpoints")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_siamese.cli", "train", "--norm", "siamese-layer", *map(str, MODEL),
         "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "300", "--lr-warmup-iters", "10",
         "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--eval-interval", "1000",
         "--eval-iters", "1", "--save", out, "--save-interval", "300"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "MEGATRON_SIAMESE_CACHE": str(tmp_path_factory.mktemp("cache"))})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def server_command(checkpoint: str, port: int):
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        "-m", "megatron_siamese.runtime.megatron_lm", "tools/run_text_generation_server.py",
        "--spec", "megatron_siamese.specs", "siamese_layer_spec", *map(str, MODEL),
        "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1",
        "--seed", "1234",
        # the byte vocabulary as `train` gives it (258 ids), padded as Megatron-LM pads it (384 at TP 1)
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "258", "--null-tokenizer-eod-id", "256",
        "--null-tokenizer-pad-id", "257",
        "--load", checkpoint, "--ckpt-format", "torch_dist", "--port", port, "--inference-max-seq-length", SEQ,
    ]


def serve(checkpoint: str, log_path: Path):
    """Start the server; returns (process, port) once it listens (its log in ``log_path``)."""
    from megatron_siamese.runtime.launch import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           # its start-up runs `make` for the dataset helpers with the python3 on PATH
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
           "TORCHDYNAMO_DISABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    log = open(log_path, "w")
    process = subprocess.Popen(list(map(str, server_command(checkpoint, port))), cwd=MEGATRON_LM, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log_path.read_text()
        if f"Running on http://127.0.0.1:{port}" in text:
            return process, port
        if process.poll() is not None:
            break
        time.sleep(1)
    stop(process)
    pytest.fail(f"the server did not start:\n{log_path.read_text()[-5000:]}")


def stop(process):
    if process.poll() is None:
        os.killpg(process.pid, 15)  # torchrun and its one rank (its own session)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def put(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def reference(model, prompt, steps):
    """Greedy tokens and the log-probability of every token after the first, recomputing the whole
    sequence at each step (no KV cache)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logprobs = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return ids, logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_the_text_generation_server_answers_with_the_checkpoints_greedy_tokens(checkpoint, tmp_path):
    import torch

    from megatron_siamese.hf.export import export, load_exported

    model = load_exported(export(checkpoint, str(tmp_path / "hf")))
    expected_tokens, expected_logprobs = reference(model, PROMPT, NEW_TOKENS)
    log = tmp_path / "server.log"
    process, port = serve(checkpoint, log)
    try:
        reply = put(port, {"prompts": [" ".join(map(str, PROMPT))], "tokens_to_generate": NEW_TOKENS, "top_k": 1,
                           "logprobs": True})
    finally:
        stop(process)
    text = log.read_text()
    # Megatron-LM's static engine tries its dynamic engine first and, on CPU, falls back to the
    # legacy static path (prefill, then one token per step against the attention's KV cache)
    assert "using legacy static engine" in text
    assert "Running on http://127.0.0.1:" in text and "0.0.0.0" not in text.split("Running on")[1][:40]

    assert reply["tokens"] == [expected_tokens]
    assert reply["text"] == [" ".join(map(str, expected_tokens))]
    assert len(set(expected_tokens[len(PROMPT):])) > 1  # a decode, not one token repeated
    assert reply["logprobs"][0] == pytest.approx(expected_logprobs, abs=2e-4)

    # the comparison catches another model: one weight changed
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0] += 0.5
    assert reply["logprobs"][0] != pytest.approx(reference(model, PROMPT, NEW_TOKENS)[1], abs=2e-4)
