"""The two-sample chi-square homogeneity test the speculative-decoding distribution tests share."""
from __future__ import annotations

import collections

# The significance level of the distribution tests: they fail when p falls below it.
SIGNIFICANCE = 0.01


def chi_square_homogeneity(first: collections.Counter, second: collections.Counter, min_expected: float = 5.0):
    """(statistic, degrees of freedom, p-value) of the two-sample chi-square test that two samples of
    categories come from one distribution; categories expected fewer than `min_expected` times in either
    sample are pooled into one."""
    from scipy.stats import chi2

    n1, n2 = sum(first.values()), sum(second.values())
    total = n1 + n2
    pooled_first = pooled_second = 0
    table = []
    for category in set(first) | set(second):
        a, b = first[category], second[category]
        if min((a + b) * n1 / total, (a + b) * n2 / total) < min_expected:
            pooled_first, pooled_second = pooled_first + a, pooled_second + b
        else:
            table.append((a, b))
    if pooled_first + pooled_second:
        table.append((pooled_first, pooled_second))
    statistic = 0.0
    for a, b in table:
        for observed, size in ((a, n1), (b, n2)):
            expected = (a + b) * size / total
            statistic += (observed - expected) ** 2 / expected
    dof = len(table) - 1
    return statistic, dof, float(chi2.sf(statistic, dof))
