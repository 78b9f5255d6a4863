"""The plan against CPU ranks: every term of every layout of check/plan_agreement.CASES.

    python bench/plan_agreement.py        # one job of up to 4 ranks (about a minute on 2 cores)

Prints, per layout, SiameseNorm path and pipeline stage, each nonzero term's measured bytes and
the plan's relative error (weights, grads, optimizer, activations, pipeline buffers, and the bytes
sent over tp, sp, pp, dp and ep), the worst error per term, and whether every term is within 5%.
"""

import time

from megatron_siamese.check.plan_agreement import CASES, TOLERANCE, compare, format_terms, measure, worst_by_term


def main():
    start = time.perf_counter()
    terms = compare(CASES, measure(CASES))
    print(format_terms(terms))
    print(worst_by_term(terms))
    worst = max(terms, key=lambda t: abs(t.error))
    print(f"{len(terms)} terms of {len(CASES)} cases in {time.perf_counter() - start:.0f} s; worst: {worst.layout} "
          f"{worst.variant} stage {worst.stage} {worst.term} {worst.error:+.2%}; "
          f"{'all' if all(t.agrees for t in terms) else 'NOT all'} within {TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
