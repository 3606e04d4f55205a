import pytest
from mars.v1 import services_pb2 as svc
from mars_ingress.service import InvalidTurn, validate_turn


def req(**kw: object) -> svc.TurnRequest:
    fields: dict[str, object] = {"tenant": "t", "user_id": "u", "session_id": "s", "text": "hello"}
    fields.update(kw)
    return svc.TurnRequest(**fields)  # type: ignore[arg-type]


def test_valid_turn_returns_options() -> None:
    assert validate_turn(req(options={"max_tokens": "64"}), 100) == {"max_tokens": "64"}
    assert validate_turn(req(session_id=""), 100) == {}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tenant": ""}, "tenant is required"),
        ({"user_id": "  "}, "user_id is required"),
        ({"user_id": "a/b"}, "user_id must match"),
        ({"session_id": "bad id"}, "session_id must match"),
        ({"text": ""}, "text is empty"),
        ({"text": " \n"}, "text is empty"),
        ({"text": "x" * 101}, "limit is 100"),
        ({"options": {"verbose": "yes"}}, "unknown option"),
        ({"options": {"stream": "yes"}}, "option stream must be"),
        ({"options": {"max_tokens": "0"}}, "max_tokens"),
        ({"options": {"max_tokens": "2000"}}, "max_tokens"),
    ],
)
def test_invalid_turns(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidTurn, match=message):
        validate_turn(req(**kw), 100)
