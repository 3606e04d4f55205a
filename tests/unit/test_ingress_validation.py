import pytest
from mars.v1 import services_pb2 as svc
from mars_ingress.admission import InvalidTurn, validate_turn


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
        # "$" matched before a final newline: these passed and every stage dead-lettered the turn.
        ({"user_id": "alice\n"}, "user_id must match"),
        ({"tenant": "acme\n"}, "tenant must match"),
        ({"session_id": "s1\n"}, "session_id must match"),
        ({"text": ""}, "text is empty"),
        ({"text": " \n"}, "text is empty"),
        ({"text": "x" * 101}, "limit is 100"),
        ({"options": {"verbose": "yes"}}, "unknown option"),
        ({"options": {"stream": "yes"}}, "option stream must be"),
        ({"options": {"remember": "no"}}, "option remember must be \"true\" or \"false\""),
        ({"options": {"max_tokens": "0"}}, "max_tokens"),
        ({"options": {"max_tokens": "2000"}}, "max_tokens"),
        ({"options": {"max_tokens": "١٢"}}, "max_tokens"),
        ({"options": {"view_tokens": "0"}}, "option view_tokens must be an integer in 1..1000000"),
        ({"options": {"view_tokens": "-5"}}, "view_tokens"),
    ],
)
def test_invalid_turns(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidTurn, match=message):
        validate_turn(req(**kw), 100)


@pytest.mark.parametrize("field", ["tenant", "user_id", "session_id", "text"])
@pytest.mark.parametrize("char", ["\x00", "\x01", "\x1b", "\x1f", "\x0b"])
def test_control_characters_are_refused_with_the_field_and_position(field: str, char: str) -> None:
    value = "ab" + char + "c"
    with pytest.raises(
        InvalidTurn, match=rf"{field} contains the control character U\+{ord(char):04X} at position 2"
    ):
        validate_turn(req(**{field: value}), 100)


def test_tab_newline_and_return_are_fine_in_text() -> None:
    assert validate_turn(req(text="line one\n\tline two\r\n"), 100) == {}
