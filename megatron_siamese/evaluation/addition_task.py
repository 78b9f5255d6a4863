"""The synthetic addition task (data/addition.py) as lm-evaluation-harness tasks written at run time
(held-out problems as JSON lines, one config per variant), so the harness runs it offline.

Each problem is a log-likelihood request, context ``"\\n347+58="``, continuation ``"405\\n"``: the
harness's ``acc`` (greedy decoding yields the continuation) is the study's exact-match accuracy.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Tuple

from megatron_siamese.data.addition import answer, split

# task name: the sum written least significant digit first (the study's addition-reversed)
TASKS: Dict[str, bool] = {"siamese_addition": False, "siamese_addition_reversed": True}
# the study's held-out problems (data/addition.py: exact_match_accuracy's defaults)
SEED = 7


def write_addition_tasks(directory: str, digits: int = 3, count: int = 500) -> Dict[str, str]:
    """The problems and the task configs of every variant in ``directory`` (an include path for
    the harness's TaskManager); returns {task name: config path}."""
    _, test = split(digits, 1, count, SEED)
    return {name: write_task(directory, name, [(f"\n{a}+{b}=", answer(a, b, reverse) + "\n") for a, b in test],
                             {"digits": digits, "reversed": reverse, "seed": SEED})
            for name, reverse in TASKS.items()}


def write_task(directory: str, name: str, requests: Iterable[Tuple[str, str]], metadata: Dict = None) -> str:
    """A log-likelihood task ``name`` of (context, continuation) requests in ``directory``:
    its JSON-lines data and its config; returns the config's path."""
    os.makedirs(directory, exist_ok=True)
    data = os.path.abspath(os.path.join(directory, f"{name}.jsonl"))
    with open(data, "w") as out:
        for context, continuation in requests:
            out.write(json.dumps({"prompt": context, "answer": continuation}) + "\n")
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data}},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": "prompt",  # a field name: the harness takes the field as it is
        "doc_to_target": "answer",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
        "metadata": {"version": 1, **(metadata or {})},
    }
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w") as out:  # JSON is YAML: no quoting rules to get wrong for paths and newlines
        json.dump(config, out, indent=2)
        out.write("\n")
    return path
