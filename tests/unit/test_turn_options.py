import pytest
from mars.domain.turn_options import InvalidOption, TurnOptions, parse_turn_options


def test_no_options_are_the_defaults() -> None:
    assert parse_turn_options({}) == TurnOptions(max_tokens=None, stream=False, remember=True, view_tokens=None)


def test_every_option_is_read() -> None:
    opts = parse_turn_options({"max_tokens": "64", "stream": "true", "remember": "false", "view_tokens": "300"})
    assert opts == TurnOptions(max_tokens=64, stream=True, remember=False, view_tokens=300)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": "0"}, "unknown option\\(s\\) temperature; known: max_tokens, remember, stream, view_tokens"),
        ({"max_tokens": "1025"}, "option max_tokens must be an integer in 1..1024"),
        ({"max_tokens": "1e3"}, "max_tokens"),
        ({"view_tokens": "1000001"}, "option view_tokens must be an integer in 1..1000000"),
        ({"stream": "1"}, 'option stream must be "true" or "false"'),
    ],
)
def test_bad_options_are_named(options: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidOption, match=message):
        parse_turn_options(options)
