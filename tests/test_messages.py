"""The typed messages a rank sends (``pipeviz.runtime.messages``): every one names its sender's rank and mesh
coordinates, and survives the JSON lines an exported script writes."""

from __future__ import annotations

import pytest

from pipeviz.runtime.messages import Done, Events, Failed, Loss, Message, NonFinite, Output, Phase, State, StepEnd
from pipeviz.schedule.mesh import Coords
from pipeviz.schedule.timeline import Event


@pytest.mark.parametrize("msg", [
    Phase(5, Coords(1, 0, 1), "stages 1, 2 ready"),
    Events(0, Coords(0, 0, 0), [Event(0, 0, "F", 1, 0.5, 0.75, 0), Event(0, -1, "COMM", -1, 0.75, 0.8, 0)]),
    Loss(3, Coords(1, 1, 0), 4, 2.25),
    Output(2, Coords(1, 0, 0), 0, b"\x00\x01bytes"),
    StepEnd(7, Coords(1, 1, 1), 2, 12.5),
    NonFinite(1, Coords(0, 1, 0), 3, ["the loss (nan)", "layer0.weight's gradient"]),
    State(6, Coords(1, 1, 0), b"tensors"),
    State(6, Coords(1, 1, 0), "state_rank6.pt"),
    Done(4, Coords(1, 0, 0)),
    Failed(2, Coords(1, 0, 0), "RuntimeError: boom", "Traceback ...", "log tail"),
])
def test_every_message_round_trips_through_json_with_its_sender(msg: Message) -> None:
    import json

    back = Message.from_json(json.loads(json.dumps(msg.to_json())))
    assert back == msg and type(back) is type(msg)
    assert isinstance(back.coords, Coords) and back.coords == msg.coords and back.rank == msg.rank


def test_an_unknown_message_type_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError,
                       match=r"Unknown message type 'Heartbeat'; valid: Done, EvalLoss, Events, ExpertTokens, Failed, "
                             r"GradNorm, LearningRate, Loss"):
        Message.from_json({"type": "Heartbeat", "rank": 0, "coords": [0, 0, 0]})
