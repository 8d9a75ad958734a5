"""A deterministic synthetic click dataset keyed by raw 64-bit ids, for dynamic vocabularies.

Each example is one user id, up to `multi_hot` item ids and a click label. Ids are raw
int64 hashes (splitmix64 of an index, so any int64 value occurs, negative ones too) that
no vocabulary lists in advance. Indices are Zipf-distributed (index 0 the most frequent)
over a universe that grows with the example index: the first example draws from the
first `1 - new_id_fraction` of `num_users` (`num_items`), the last from all of it, so new
ids keep appearing, mostly in the long tail. Rows of `items` hold 1 to `multi_hot` ids
(fewer for most), padded on the right with PAD (0, which no id equals). Labels come from
a hidden logistic model: logit = user weight + sum of item weights / sqrt(count) + bias,
each id's weight drawn once from N(0, `weight_scale`^2); `logit` is returned too, so the
best AUC any model can reach is `auc(data["label"], data["logit"])`. Numpy only.

    from benchmarks import raw_id_data
    data = raw_id_data.make(200_000, seed=0)
    train, validation = raw_id_data.split(data, 0.1)   # validation: the last 10%
    print(raw_id_data.auc(validation["label"], validation["logit"]))  # the hidden model's

    python -m benchmarks.raw_id_data [--examples 200000]   # sizes, id counts, AUCs
"""

import numpy as np

PAD = 0  # pads rows of `items`; make() checks that no id equals it
_USER_SALT, _ITEM_SALT = 0x5EED_0001 << 32, 0x5EED_0002 << 32  # separate id spaces


def splitmix64(x):
    """splitmix64 of uint64 `x` (a bijection), as int64: raw ids over the whole range."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def _zipf_index(rng, universe, exponent):
    """One index in [0, universe[i]) per entry, P(k) roughly proportional to (k + 1)^-s
    (the inverse CDF of a continuous power law on [1, universe + 1))."""
    u = rng.random(universe.shape)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * np.log(universe + 1.0))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * ((universe + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, universe - 1)


def make(num_examples, seed=0, num_users=200_000, num_items=50_000, new_id_fraction=0.5,
         zipf=1.1, multi_hot=5, weight_scale=1.0, bias=-0.5):
    """{"user": int64 [N], "items": int64 [N, multi_hot] (PAD-padded), "label": float32
    [N] of 0/1, "logit": float32 [N] (the hidden model's)}, in time order."""
    if not 0.0 <= new_id_fraction < 1.0 or multi_hot < 1 or num_examples < 1:
        raise ValueError("need 0 <= new_id_fraction < 1, multi_hot >= 1, num_examples >= 1")
    rng = np.random.default_rng(seed)
    growth = (1.0 - new_id_fraction) + new_id_fraction * (np.arange(num_examples) + 1.0) \
        / num_examples  # share of each universe open at each example

    def universe(total):
        return np.maximum(1, np.round(total * growth)).astype(np.int64)

    user_index = _zipf_index(rng, universe(num_users), zipf)
    item_universe = np.repeat(universe(num_items)[:, None], multi_hot, axis=1)
    item_index = _zipf_index(rng, item_universe, zipf)
    count = np.minimum(rng.geometric(0.45, num_examples), multi_hot)  # ids per row, >= 1
    valid = np.arange(multi_hot)[None, :] < count[:, None]

    user_weight = rng.normal(0.0, weight_scale, num_users).astype(np.float32)
    item_weight = rng.normal(0.0, weight_scale, num_items).astype(np.float32)
    logit = (bias + user_weight[user_index]
             + (item_weight[item_index] * valid).sum(axis=1) / np.sqrt(count))
    label = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)

    user = splitmix64(user_index.astype(np.uint64) + np.uint64(_USER_SALT))
    items = np.where(valid, splitmix64(item_index.astype(np.uint64) + np.uint64(_ITEM_SALT)),
                     PAD)
    if np.any(user == PAD) or np.any(items[valid] == PAD):
        raise AssertionError(f"an id hashed to the pad value {PAD}")
    return {"user": user, "items": items, "label": label, "logit": logit.astype(np.float32)}


def split(data, validation_fraction):
    """(train, validation): the last `validation_fraction` of the examples (in time order)
    is validation."""
    n = len(data["label"])
    cut = n - int(round(n * validation_fraction))
    if not 0 < cut <= n:
        raise ValueError(f"validation_fraction {validation_fraction} leaves no training data")
    return ({k: v[:cut] for k, v in data.items()}, {k: v[cut:] for k, v in data.items()})


def auc(labels, scores):
    """ROC AUC of `scores` for 0/1 `labels` (Mann-Whitney, ties counted as half)."""
    labels, scores = np.asarray(labels) > 0.5, np.asarray(scores, dtype=np.float64)
    positives, negatives = labels.sum(), (~labels).sum()
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # average 1-based rank of each tie group
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0)
                 / (positives * negatives))


def _main():
    import argparse  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, validation = split(make(args.examples, seed=args.seed), 0.1)
    for name, part in (("train", train), ("validation", validation)):
        ids = part["items"][part["items"] != PAD]
        print(f"{name}: {len(part['label'])} examples, click rate "
              f"{part['label'].mean():.3f}, {len(np.unique(part['user']))} users, "
              f"{len(np.unique(ids))} items, hidden model's AUC "
              f"{auc(part['label'], part['logit']):.4f}")
    unseen = ~np.isin(validation["user"], train["user"])
    print(f"validation users unseen in training: {unseen.mean():.1%}; "
          f"negative user ids: {(train['user'] < 0).mean():.1%}")


if __name__ == "__main__":
    _main()
