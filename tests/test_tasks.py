"""mnist1d-cnn's options: the default model is unchanged by the optional wide head; bad sizes are one-line errors."""

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
