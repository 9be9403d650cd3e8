"""The tasks: mnist1d-cnn's options (the default model is unchanged by the optional wide head; bad sizes are one-line
errors) and the digits tasks' split, read without scikit-learn."""

import pytest
import torch

from gradsift.tasks import TaskError, make_task


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_wide_head_adds_one_hidden_layer_and_the_default_model_is_as_before():
    plain = make_task("mnist1d-cnn", workers=2).make_model()
    assert count(plain) == 8010  # 32 channels, the classifier straight after the convolutions
    wide = make_task("mnist1d-cnn", workers=2, channels=128, hidden=16384).make_model()
    c, h = 128, 16384
    convs = (1 * 5 + 1) * c + 2 * (c * 3 + 1) * c
    assert count(wide) == convs + (c * 5 + 1) * h + (h + 1) * 10
    assert count(wide) * 0.001 >= 10_000  # k of the whole model at 0.1%, REGTOP-k's CNN reproduction
    x = torch.randn(3, 1, 40)
    assert wide(x).shape == plain(x).shape == (3, 10)


@pytest.mark.parametrize("options, word", [({"hidden": -1}, "hidden"), ({"hidden": 2.5}, "hidden"),
                                           ({"channels": 0}, "channels"), ({"channels": True}, "channels")])
def test_bad_sizes_are_one_line_errors(options, word):
    with pytest.raises(TaskError, match=f"mnist1d-cnn: {word} must be an integer >= "):
        make_task("mnist1d-cnn", workers=2, **options).make_model()


def test_the_digits_split_is_scikit_learns_own_read_without_importing_it():
    """digits-mlp and digits-cnn read the bundled digits and the committed split without importing scikit-learn;
    the arrays are the ones ``load_digits`` and ``train_test_split(test_size=0.2, random_state=0, stratify=y)``
    give, in the same order."""
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from gradsift.tasks.digits import load_digits_split

    d = load_digits()
    want = train_test_split((d.data / 16.0).astype(np.float32), d.target, test_size=0.2, random_state=0,
                            stratify=d.target)
    xtr, ytr, xte, yte = load_digits_split()
    for got, ref in zip((xtr, xte, ytr, yte), want):
        assert got.dtype == ref.dtype and np.array_equal(got, ref)
    code = ("import sys; from gradsift.tasks.digits import load_digits_split; load_digits_split(); "
            "print(any(m == 'sklearn' or m.startswith('sklearn.') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]
