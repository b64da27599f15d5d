"""The main demo trains: its loss falls."""

from functe import demo


def test_demo_loss_falls(capsys):
    losses = demo.train(steps=150, log_every=50)
    assert losses[-1] < 0.5 * losses[0]
    assert "step  150" in capsys.readouterr().out


def test_fused_block_demo_explains_and_trains(capsys):
    losses = demo.train_fused(steps=60, log_every=20)
    assert losses[-1] < 0.6 * losses[0]
    out = capsys.readouterr().out
    assert "fired: backward_linear_bias_activation x1, backward_add_norm x1" in out
    assert "declined: forward_linear_bias_activation" in out and "traced 1x" in out
