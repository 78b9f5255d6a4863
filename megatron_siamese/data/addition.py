"""A synthetic multi-digit addition task: generated problems, exact-match accuracy.

Documents are lines ``"347+58=405\\n"`` as byte tokens in Megatron's indexed format; evaluation decodes
greedily after ``"347+58="`` and counts a problem only if every digit is right. ``addition-reversed``
writes the sum least significant digit first, the order a left-to-right model computes carries in,
which small transformers learn far sooner (Lee et al., "Teaching Arithmetic to Small Transformers").
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import List, Tuple

import torch

from megatron_siamese.data.corpus import ByteTokenizer, cached_indexed_dataset


def problems(count: int, digits: int, seed: int) -> List[Tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a = rng.randrange(10 ** rng.randint(1, digits))
        b = rng.randrange(10 ** rng.randint(1, digits))
        out.append((a, b))
    return out


def split(digits: int, train_count: int, test_count: int, seed: int):
    """Disjoint train and test problems."""
    test = problems(test_count, digits, seed + 1)
    held_out = set(test)
    train = [p for p in problems(train_count + test_count, digits, seed) if p not in held_out][:train_count]
    return train, test




def answer(a: int, b: int, reverse: bool = False) -> str:
    digits = str(a + b)
    return digits[::-1] if reverse else digits


def line(a: int, b: int, reverse: bool = False) -> str:
    return f"{a}+{b}={answer(a, b, reverse)}\n"


def addition_corpus(cache_dir: str, reverse: bool = False, digits: int = 3, train_count: int = 200_000,
                    seed: int = 7) -> str:
    """The training problems as an indexed dataset under ``cache_dir`` (64 to a document); returns its prefix."""
    train, _ = split(digits, train_count, 1000, seed)
    key = hashlib.sha256(f"{digits}-{train_count}-{seed}{'-reversed' if reverse else ''}".encode()).hexdigest()[:10]

    def documents():
        lines = [line(a, b, reverse) for a, b in train]
        return ["".join(lines[i : i + 64]) for i in range(0, len(lines), 64)]

    return cached_indexed_dataset(os.path.join(cache_dir, f"addition-{key}"), documents)


@torch.no_grad()
def exact_match_accuracy(model, reverse: bool = False, digits: int = 3, count: int = 500, seed: int = 7,
                         batch: int = 100) -> float:
    """Greedy-decoding accuracy of a single-rank (TP=PP=1) GPTModel on held-out problems."""
    tokenizer = ByteTokenizer()
    _, test = split(digits, 1, count, seed)
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(test), batch):
        chunk = test[start : start + batch]
        prompts = [tokenizer.tokenize(f"{a}+{b}=") for a, b in chunk]
        answers = [answer(a, b, reverse) for a, b in chunk]
        width = max(len(p) for p in prompts)
        # left-pad with newlines (a problem boundary in the training text) so prompts align
        tokens = torch.tensor([[ord("\n")] * (width - len(p)) + p for p in prompts], device=device)
        generated = [[] for _ in chunk]
        for _ in range(digits + 2):
            length = tokens.shape[1]
            positions = torch.arange(length, device=device).expand_as(tokens)
            mask = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]
            logits = model(tokens, positions, mask)
            next_token = logits[:, -1].argmax(dim=-1)
            for i, t in enumerate(next_token.tolist()):
                generated[i].append(t)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        for out, expected in zip(generated, answers):
            text = tokenizer.detokenize(out)
            correct += text.split("\n")[0] == expected
    return correct / len(test)
