"""Sealing user text in events (mars.sealing): which fields, round trips, what refuses to open."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.descriptor import FieldDescriptor
from mars import sealing
from mars.config import ServiceSettings
from mars.data_keys import master_key
from mars.v1 import events_pb2 as ev

SECRET = "my account number is 4242"


def _generated() -> ev.Generated:
    turn = ev.TurnEnvelope(turn_id="t1", tenant="acme", user_id="u1", session_id="s", seq=3)
    return ev.Generated(
        turn=turn,
        status=ev.OK,
        model="small",
        text=f"you said {SECRET}",
        query=SECRET,
        state=ev.SessionState(lens_reason=f"user mentions {SECRET}"),
        packed_blocks=[
            ev.MemoryBlock(block_id="b1", text=f"earlier: {SECRET}"),
            ev.MemoryBlock(block_id="b2", text=""),
        ],
        attempts=[ev.GenerationAttempt(arm="small", ok=True)],
        policy_id="user:acme/u1",
    )


def _texts(msg: ev.Generated) -> list[str]:
    return [msg.text, msg.query, msg.state.lens_reason, *(b.text for b in msg.packed_blocks)]


def test_every_string_field_of_every_turn_event_is_classified() -> None:
    """A string field of a turn event is user text or an id/label we name here: a new free-text field
    must be marked (user_text) or added to this list knowingly."""
    not_text = {
        "turn_ids",
        "turn_id", "tenant", "user_id", "session_id", "data_key_id", "backend", "fallback_reason",
        "prompt_version", "clamped_fields", "risk_flags", "block_id", "source_turn_id", "source_session_id",
        "policy", "arm", "chosen_arm", "policy_id", "fallback_order", "previous_arm", "model", "error",
        "packed_block_ids", "judge", "failed_arms", "judge_fallback_reason", "correction_id",
        "reward_source", "record_id", "thread_id", "source_topic", "reason", "consumer", "forget_id", "outcome",
        "text_embedder", "config_version", "shadow_version", "shadow_arm", "rollout_role", "canary_version",
        "live_version", "candidate_version", "decision", "rule", "evidence_json",
    }  # fmt: skip
    seen: set[str] = set()

    def walk(desc: object, path: str) -> None:
        for field in desc.fields:  # type: ignore[attr-defined]
            if field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
                walk(field.message_type, f"{path}.{field.name}")
            elif field.type == FieldDescriptor.TYPE_STRING:
                marked = field.GetOptions().Extensions[ev.user_text]
                seen.add(field.name)
                assert marked or field.name in not_text, f"{path}.{field.name}: user text or not?"
                assert not (marked and field.name in not_text), f"{path}.{field.name} is marked user text"

    for name in ev.DESCRIPTOR.message_types_by_name:
        walk(ev.DESCRIPTOR.message_types_by_name[name], name)
    assert {"text", "query", "comment", "lens_reason"} <= seen


def test_seal_hides_every_text_field_and_unseal_brings_it_back() -> None:
    key = AESGCM(sealing.new_key())
    plain = _generated()
    sealed = sealing.seal(plain, plain.turn, "k1", key)
    assert plain.turn.data_key_id == "" and plain.query == SECRET  # the original is untouched
    assert sealed.turn.data_key_id == "k1"
    wire = sealed.SerializeToString()
    assert SECRET.encode() not in wire and b"4242" not in wire
    # Ids, numbers and labels stay readable (routing, replay and OPE use them).
    assert sealed.policy_id == "user:acme/u1" and sealed.model == "small" and sealed.turn.seq == 3
    assert sealed.packed_blocks[1].text == ""  # empty stays empty
    opened = ev.Generated.FromString(wire)
    sealing.unseal(opened, key)
    assert _texts(opened) == _texts(plain)
    assert opened.turn.data_key_id == "k1"  # what a stage publishes from it is sealed again


def test_the_same_text_seals_differently_each_time() -> None:
    key = AESGCM(sealing.new_key())
    a = sealing.seal(_generated(), _generated().turn, "k1", key)
    b = sealing.seal(_generated(), _generated().turn, "k1", key)
    assert a.query != b.query  # a fresh nonce per field: equal texts are not linkable


def test_a_wrong_key_a_moved_value_or_tampering_does_not_open() -> None:
    key = AESGCM(sealing.new_key())
    sealed = sealing.seal(_generated(), _generated().turn, "k1", key)
    wrong = ev.Generated()
    wrong.CopyFrom(sealed)
    with pytest.raises(sealing.SealError, match="does not open"):
        sealing.unseal(wrong, AESGCM(sealing.new_key()))
    moved = ev.Generated()
    moved.CopyFrom(sealed)
    moved.turn.turn_id = "t2"  # a sealed value bound to t1 carried into another turn's event
    with pytest.raises(sealing.SealError):
        sealing.unseal(moved, key)
    tampered = ev.Generated()
    tampered.CopyFrom(sealed)
    assert tampered.text.startswith(sealing.V2)
    raw = bytearray(base64.b64decode(tampered.text.removeprefix(sealing.V2)))
    raw[-1] ^= 1
    tampered.text = sealing.V2 + base64.b64encode(bytes(raw)).decode()
    with pytest.raises(sealing.SealError):
        sealing.unseal(tampered, key)
    garbage = ev.Generated()
    garbage.CopyFrom(sealed)
    garbage.query = "not base64 at all!"
    with pytest.raises(sealing.SealError):
        sealing.unseal(garbage, key)


def test_a_sealed_value_is_bound_to_the_tenant_the_user_and_the_field() -> None:
    key = AESGCM(sealing.new_key())
    sealed = sealing.seal(_generated(), _generated().turn, "k1", key)
    for change in ({"tenant": "globex"}, {"user_id": "u2"}):
        replayed = ev.Generated()
        replayed.CopyFrom(sealed)
        for name, value in change.items():
            setattr(replayed.turn, name, value)  # user B's sealed text in an event claiming to be A's
        with pytest.raises(sealing.SealError, match="does not open"):
            sealing.unseal(replayed, key)
    swapped = ev.Generated()
    swapped.CopyFrom(sealed)
    swapped.query, swapped.text = sealed.text, sealed.query  # the answer presented as the question
    with pytest.raises(sealing.SealError):
        sealing.unseal(swapped, key)


def test_values_sealed_before_v2_still_open() -> None:
    """Events already on the topics were sealed with the key and turn as associated data only."""
    import os

    key = AESGCM(sealing.new_key())
    nonce = os.urandom(sealing.NONCE_BYTES)
    old = base64.b64encode(nonce + key.encrypt(nonce, SECRET.encode(), b"k1\x1ft1")).decode()
    event = ev.Feedback(turn=ev.TurnEnvelope(turn_id="t1", tenant="acme", user_id="u1", data_key_id="k1"))
    event.comment = old
    sealing.unseal(event, key)
    assert event.comment == SECRET


def test_a_keyring_opens_only_with_the_key_of_the_events_user() -> None:
    """An event naming another user's key id is refused before anything is opened with that key."""
    from mars.data_keys import Forgotten, SyncKeyring

    master = sealing.new_key()
    wrapped = sealing.wrap(AESGCM(master), "kb", "acme", "bob", bytes(32))

    class Conn:
        def execute(self, sql: str, params: tuple[str, ...]) -> Conn:
            self.row = ("acme", "bob", wrapped, "") if params == ("kb",) else None
            return self

        def fetchone(self) -> tuple[str, str, bytes, str] | None:
            return self.row

    keyring = SyncKeyring(Conn(), master)
    bobs = sealing.seal(
        ev.Feedback(turn=ev.TurnEnvelope(turn_id="t9", tenant="acme", user_id="bob"), comment=SECRET),
        ev.TurnEnvelope(turn_id="t9", tenant="acme", user_id="bob"),
        "kb",
        keyring.key("kb"),  # type: ignore[arg-type]
    )
    as_alice = ev.Feedback()
    as_alice.CopyFrom(bobs)
    as_alice.turn.user_id = "alice"
    with pytest.raises(sealing.SealError, match="not the key of the turn's tenant and user"):
        keyring.unseal(as_alice)
    keyring.unseal(bobs)
    assert bobs.comment == SECRET
    gone = ev.Feedback()
    gone.CopyFrom(as_alice)
    gone.turn.data_key_id = "k-deleted"
    with pytest.raises(Forgotten):
        keyring.unseal(gone)


def test_events_without_user_text_are_not_sealed() -> None:
    assert not sealing.has_user_text(ev.Judged)
    assert not sealing.has_user_text(ev.MemoryCommitted)
    assert sealing.has_user_text(ev.Feedback) and sealing.has_user_text(ev.TokenChunk)
    assert sealing.has_user_text(ev.Routed)  # through its view's blocks and state's lens_reason


def test_wrapped_data_keys_open_only_with_their_master_key_and_owner() -> None:
    master = AESGCM(sealing.new_key())
    data = sealing.new_key()
    wrapped = sealing.wrap(master, "k1", "acme", "u1", data)
    assert data not in wrapped
    assert sealing.unwrap(master, "k1", "acme", "u1", wrapped) == data
    with pytest.raises(sealing.SealError, match="master key"):
        sealing.unwrap(AESGCM(sealing.new_key()), "k1", "acme", "u1", wrapped)
    with pytest.raises(sealing.SealError):
        sealing.unwrap(master, "k1", "acme", "u2", wrapped)  # another user's row


def test_master_key_from_file_or_variable_with_clear_errors(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "master.key"  # type: ignore[operator]
    path.write_text(sealing.master_key_text())
    assert len(master_key(ServiceSettings(master_key_file=str(path))) or b"") == 32
    assert master_key(ServiceSettings()) is None
    text = path.read_text().strip()
    assert master_key(ServiceSettings(master_key=text)) == base64.b64decode(text)
    with pytest.raises(ValueError, match=r"MARS_MASTER_KEY_FILE .*No such file"):
        master_key(ServiceSettings(master_key_file=str(path) + ".missing"))
    path.write_text(base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="32 bytes"):
        master_key(ServiceSettings(master_key_file=str(path)))
    with pytest.raises(ValueError, match=r"MARS_MASTER_KEY: .*base64"):
        master_key(ServiceSettings(master_key="not base64 !!"))


def test_keys_master_writes_a_new_private_file_and_never_overwrites(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from mars_tools.cli import build_parser

    out = tmp_path / "master.key"  # type: ignore[operator]
    args = build_parser().parse_args(["keys", "master", "--out", str(out)])
    assert args.func(args) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    first = out.read_text()
    assert len(sealing.parse_master_key(first)) == 32
    assert args.func(args) == 1 and out.read_text() == first  # a master key is never replaced
    printed = build_parser().parse_args(["keys", "master"])
    capsys.readouterr()
    assert printed.func(printed) == 0
    assert len(sealing.parse_master_key(capsys.readouterr().out)) == 32


def test_sealing_benchmark_short_run() -> None:
    """load-tests/sealing_bench.py, a few turns: it seals and opens real turn-shaped events and says so."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "load-tests" / "sealing_bench.py"
    run = subprocess.run(
        [sys.executable, str(script), "--turns", "20"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["turns"] == 20 and out["events_per_turn"] == 6
    assert out["bytes_per_turn"]["sealed"] > out["bytes_per_turn"]["plaintext"] > 5000
    assert out["sealed_serialize_parse_us"]["p50"] > out["plaintext_serialize_parse_us"]["p50"] > 0


def test_master_keys_open_rows_by_the_id_of_the_key_that_wrapped_them() -> None:
    from mars.data_keys import MasterKeys

    old, new = sealing.new_key(), sealing.new_key()
    data = sealing.new_key()
    wrapped_old, old_id = MasterKeys(old).wrap("k1", "acme", "u1", data)
    assert old_id == sealing.master_key_id(old) != sealing.master_key_id(new)
    assert old.hex() not in old_id and len(old_id) == 16  # a name, not the key
    rotating = MasterKeys(new, (old,))
    assert rotating.unwrap("k1", "acme", "u1", wrapped_old, old_id) == data
    assert rotating.unwrap("k1", "acme", "u1", wrapped_old, "") == data  # a row from before ids: tried
    assert not rotating.opens_with_current("k1", "acme", "u1", wrapped_old, old_id)
    rewrapped, new_id = rotating.wrap("k1", "acme", "u1", data)
    assert (
        new_id == rotating.current_id
        and MasterKeys(new).unwrap("k1", "acme", "u1", rewrapped, new_id) == data
    )
    with pytest.raises(
        sealing.SealError, match=f"wrapped by master key {old_id}, which this process does not"
    ):
        MasterKeys(new).unwrap("k1", "acme", "u1", wrapped_old, old_id)
    with pytest.raises(sealing.SealError, match="does not open with this master key"):
        MasterKeys(new).unwrap("k1", "acme", "u1", wrapped_old, "")


def test_previous_master_key_needs_a_current_one(tmp_path: pytest.TempPathFactory) -> None:
    from mars.data_keys import master_keys

    previous = tmp_path / "old.key"  # type: ignore[operator]
    previous.write_text(sealing.master_key_text())
    with pytest.raises(ValueError, match="MARS_PREVIOUS_MASTER_KEY_FILE is set but no MARS_MASTER_KEY_FILE"):
        master_keys(ServiceSettings(previous_master_key_file=str(previous)))
    current = tmp_path / "new.key"  # type: ignore[operator]
    current.write_text(sealing.master_key_text())
    both = master_keys(ServiceSettings(master_key_file=str(current), previous_master_key_file=str(previous)))
    assert both is not None and both.current_id == sealing.master_key_id(
        sealing.parse_master_key(current.read_text())
    )
    with pytest.raises(ValueError, match="MARS_PREVIOUS_MASTER_KEY_FILE /nope"):
        master_keys(ServiceSettings(master_key_file=str(current), previous_master_key_file="/nope"))
