"""Router replay's routing on a wire of (rows, width) tensors (spmdrl.rl.batch.pack_routed / unpack_routed,
which the async rows, balance_tokens and the teacher's own ranks move): shifted by one so the wire's zero
padding reads back as no choice, flattened position by position so a row sent narrower than another
arrives with its extra positions empty."""

from __future__ import annotations

import torch

from spmdrl.rl.batch import ROUTED, ROUTED_SHAPE, pack_routed, unpack_routed


def test_routing_survives_the_wire_and_its_padding() -> None:
    g = torch.Generator().manual_seed(0)
    routed = torch.randint(0, 4, (3, 5, 4, 2), generator=g).to(torch.int16)
    routed[1, 3:] = -1  # a shorter row
    wire = pack_routed(routed, 3, torch.device("cpu"))
    assert wire[ROUTED].shape == (3, 5 * 4 * 2) and int(wire[ROUTED].min()) == 0
    # The wire arrives wider (another sender's rows were longer): zeros past each row's own columns.
    wider = torch.cat([wire[ROUTED], torch.zeros(3, 2 * 4 * 2, dtype=torch.int16)], dim=1)
    back = unpack_routed({ROUTED: wider, ROUTED_SHAPE: wire[ROUTED_SHAPE]}, width=7)
    assert back is not None and back.shape == (3, 7, 4, 2)
    assert torch.equal(back[:, :5], routed) and bool((back[:, 5:] == -1).all())
    # Trimmed to the batch's width, as unpack trims every field.
    assert torch.equal(
        unpack_routed({ROUTED: wider, ROUTED_SHAPE: wire[ROUTED_SHAPE]}, width=4), routed[:, :4]
    )


def test_rows_without_routing_carry_an_empty_field() -> None:
    wire = pack_routed(None, 2, torch.device("cpu"))
    assert wire[ROUTED].shape == (2, 0) and wire[ROUTED_SHAPE].tolist() == [[0, 0], [0, 0]]
    assert unpack_routed(wire, width=6) is None
