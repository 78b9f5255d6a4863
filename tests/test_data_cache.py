"""Jobs that share a data cache directory (two runs from one directory, a study's runs side by
side) build in it one at a time: a build waits while another job holds the cache's build lock,
and then finds whole files instead of reading a corpus mid-write."""

import os
import threading
import time

from megatron_siamese.data.cache_lock import building
from megatron_siamese.data.corpus import ByteTokenizer, build_indexed_dataset

WAIT_S = 2.0  # how long a build must stay blocked: an unguarded one writes within a fraction of it


def built_files(directory):
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def blocked_while_held(cache, build):
    """Start ``build`` while this test holds ``cache``'s lock: what it wrote meanwhile, and what
    it wrote once let go."""
    done = threading.Event()
    failure = []

    def run():
        try:
            build()
        except BaseException as error:  # re-raised in the test
            failure.append(error)
        finally:
            done.set()

    with building(cache):
        before = built_files(cache)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        finished_while_held = done.wait(WAIT_S)
        during = built_files(cache)
    assert done.wait(60), "the build did not finish once the lock was free"
    if failure:
        raise failure[0]
    return finished_while_held, during != before, built_files(cache)


def test_a_corpus_is_built_only_while_no_other_job_builds(tmp_path):
    from megatron_siamese.data.addition import addition_corpus

    cache = str(tmp_path / "cache")
    finished, wrote, after = blocked_while_held(cache, lambda: addition_corpus(cache, train_count=500))
    assert not finished and not wrote
    assert {name.rsplit(".", 1)[-1] for name in after} == {"bin", "idx"}


def test_a_corpus_another_job_built_while_this_one_waited_is_read_not_built_again(tmp_path):
    """The waiting build looks again once it holds the lock, and reads the first job's files."""
    from megatron_siamese.data.addition import addition_corpus

    name = os.path.basename(addition_corpus(str(tmp_path / "elsewhere"), train_count=500))
    cache = str(tmp_path / "cache")
    second = []
    with building(cache):
        waiting = threading.Thread(target=lambda: second.append(addition_corpus(cache, train_count=500)))
        waiting.start()
        time.sleep(0.5)  # the second job is at the lock (or about to be): it finds no corpus yet
        first = build_indexed_dataset(["1+1=2\n"], os.path.join(cache, name), ByteTokenizer())  # the first job's
        written = os.stat(first + ".bin").st_mtime_ns
    waiting.join(60)
    assert second == [first] and os.stat(first + ".bin").st_mtime_ns == written
