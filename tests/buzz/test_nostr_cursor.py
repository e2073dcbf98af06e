"""Pure Nostr primitives and cursors."""

from __future__ import annotations

from coincurve import PublicKeyXOnly
from twisted.trial import unittest

from relayd.buzz import nostr
from relayd.buzz.core import cursor
from tests.support.cases import cases, expand

KEY = cursor.derive_key(b"k" * 32)
SCOPE = cursor.Scope("p" * 64, "chan", "", False)


@expand
class NostrPrimitivesAndCursors(unittest.TestCase):
    def test_bip340_vector_0_public_key_and_verification(self) -> None:
        s = nostr.Signer((3).to_bytes(32, "big"))
        assert s.pubkey == "f9308a019258c31049344f85f89d5229b531c845836f99b08601f113bce036f9"
        sig = bytes.fromhex(
            "E907831F80848D1069A5371B402410364BDF1C5F8307B0084C55F1CE2DCA821525F66A4A85EA8B71E482A74F382D2CE5EBEEE8FDB2172F477DF4900D310536C0"
        )
        assert PublicKeyXOnly(bytes.fromhex(s.pubkey)).verify(sig, b"\x00" * 32)

    def test_signed_events_verify_independently(self) -> None:
        import json

        import nostr_sdk

        s = nostr.Signer(nostr.generate_secret())
        for content in ("plain", "é🐝\u2028\x7f", "ctl\x01\x1f", 'q"\\\n\t'):
            ev = s.sign(9, [["h", "c"], ["p", s.pubkey]], content, 1_787_675_388)
            assert nostr.verify_event(ev)
            assert nostr_sdk.Event.from_json(json.dumps(ev)).verify()
            assert not nostr.verify_event({**ev, "content": content + "x"})

    @cases(
        core=("core", "bdc233238ffe52e272b44cc233c8f33a2bc510b08be04495b225964283be4a90"),
        mem_example=("mem/example", "72d4f9629106451505d7d341ea85bb3ebad4f654fcfd2aad100d5a35f8a85cba"),
        mem_notes_date=("mem/notes/2026-05-12", "31651571a312780cfdc1f0b706b682ac9f3f51a053e8dca76fe57710bae5a4d4"),
    )
    def test_nip_ae_d_tag_vectors(self, slug: str, d: str) -> None:
        kc = nostr.conversation_key((1).to_bytes(32, "big"), "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5")
        assert kc.hex() == "c41c775356fd92eadc63ff5a0dc1da211b268cbea22316767095b2871ea1412d"
        assert nostr.d_tag(kc, slug) == d

    def test_conversation_key_is_symmetric(self) -> None:
        a, b = nostr.Signer(nostr.generate_secret()), nostr.Signer(nostr.generate_secret())
        assert a.conversation_key(b.pubkey) == b.conversation_key(a.pubkey)

    def test_secret_key_text_forms(self) -> None:
        import nostr_sdk

        k = nostr_sdk.Keys.generate()
        assert nostr.parse_secret_key(k.secret_key().to_bech32()).hex() == k.secret_key().to_hex()
        assert nostr.parse_secret_key(" " + k.secret_key().to_hex() + "\n").hex() == k.secret_key().to_hex()
        nsec = k.secret_key().to_bech32()
        broken = nsec[:-1] + ("q" if nsec[-1] != "q" else "p")  # a checksum character changed (never to itself)
        for bad in ("", "00" * 32, "ff" * 32, "nsec1qqqq", broken, "zz" * 32):
            with self.assertRaises(ValueError):
                nostr.parse_secret_key(bad)

    def test_thread_root_derivation(self) -> None:
        root, mid = "a" * 64, "b" * 64
        assert nostr.thread_root_for_reply({"id": root, "tags": [["h", "c"]]}) == root
        assert nostr.thread_root_for_reply({"id": mid, "tags": [["e", root, "", "reply"]]}) == root
        nested = {"id": "c" * 64, "tags": [["e", root, "", "root"], ["e", mid, "", "reply"]]}
        assert nostr.thread_root_for_reply(nested) == root
        assert nostr.reply_tags("c", root, root) == [["h", "c"], ["e", root, "", "reply"]]
        assert nostr.reply_tags("c", root, mid) == [["h", "c"], ["e", root, "", "root"], ["e", mid, "", "reply"]]

    def test_cursor_round_trip_and_grammar(self) -> None:
        pos = cursor.Position(1_787_675_388, "ab" * 32)
        text = cursor.issue(KEY, SCOPE, pos)
        assert len(text) <= 256 and all(0x21 <= ord(ch) <= 0x7E for ch in text)
        assert cursor.open_cursor(KEY, SCOPE, text) == pos

    def test_cursor_rejects_foreign_tampered_or_rebound(self) -> None:
        text = cursor.issue(KEY, SCOPE, cursor.Position(5, "00" * 32))
        for scope in (
            cursor.Scope("q" * 64, "chan"),
            cursor.Scope("p" * 64, "other"),
            cursor.Scope("p" * 64, "chan", "r" * 64),
            cursor.Scope("p" * 64, "chan", "", True),
        ):
            with self.assertRaises(cursor.CursorError):
                cursor.open_cursor(KEY, scope, text)
        with self.assertRaises(cursor.CursorError):
            cursor.open_cursor(cursor.derive_key(b"x" * 32), SCOPE, text)
        v, payload, mac = text.split(".")
        flipped = payload[:-1] + ("A" if payload[-1] != "A" else "B")
        for bad in (f"{v}.{flipped}.{mac}", f"c2.{payload}.{mac}", "c1", "c1..", "c1.!!.!!"):
            with self.assertRaises(cursor.CursorError):
                cursor.open_cursor(KEY, SCOPE, bad)

    def test_position_order_is_newest_first_ties_by_id(self) -> None:
        pos = cursor.Position(10, "5" * 64)
        assert pos.is_after(9, "0" * 64)
        assert pos.is_after(10, "6" * 64)
        assert not pos.is_after(10, "5" * 64)
        assert not pos.is_after(10, "4" * 64)
        assert not pos.is_after(11, "9" * 64)
