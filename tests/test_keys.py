"""The run's DHT keys and stream names (swarm/keys.py): the formats stay byte for byte what peers of
this protocol version read, and every key a peer writes parses back to the record kind whose schema
checks it."""
from __future__ import annotations

from p2pdiloco.ids import short_id, short_ids
from p2pdiloco.swarm import keys


def test_keys_are_the_wire_formats():
    assert keys.progress_key("r1") == "r1:progress"
    assert keys.history_key("r1") == "r1:history"
    assert keys.fingerprint_key("r1") == "r1:fingerprint"
    assert keys.ready_key("r1", 2, 17) == "r1:mm:2:17"
    assert keys.group_key("r1", 0, 5) == "r1:group:0:5"
    assert keys.handler_name("r1", "join") == "p2pdiloco.r1.join"


def test_every_key_parses_back_to_its_record_kind():
    made = {"progress": keys.progress_key("a-run"), "history": keys.history_key("a-run"),
            "fingerprint": keys.fingerprint_key("a-run"),
            "ready": keys.ready_key("a-run", 1, 9), "group": keys.group_key("a-run", 3, 4)}
    for kind, key in made.items():
        assert keys.kind_of(key) == kind
        assert kind in keys.RECORD_KINDS


def test_short_ids_are_the_last_six_characters():
    pid = "12D3KooWAbCdEfGhIjK"
    assert short_id(pid) == "fGhIjK"
    assert short_ids(["xx123456", "yy654321"]) == "{123456, 654321}"
