"""The main demo trains: its loss falls."""

from functe import demo


def test_demo_loss_falls(capsys):
    losses = demo.train(steps=150, log_every=50)
    assert losses[-1] < 0.5 * losses[0]
    assert "step  150" in capsys.readouterr().out
