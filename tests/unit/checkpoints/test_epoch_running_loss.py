"""The epoch's running training loss carried by a checkpoint into the resumed run.

Devices: none (the checkpoint's recorded sums, read for one rank).
"""

from __future__ import annotations

from paratrain.checkpoints.state.snapshot import epoch_running_loss

#: saved by fsdp --tp 2 on 4 processes: ranks 0 and 1 (a tp group) counted the same 8
#: samples, as did ranks 2 and 3; ranks 0 and 2 stand for the data
TP_2X2 = {
    "world_size": 4,
    "epoch_loss_sums": [16.0, 16.0, 24.0, 24.0],
    "epoch_samples": [8, 8, 8, 8],
    "epoch_data_leaders": [0, 2],
}


def test_the_same_world_size_resumes_each_process_with_its_own_sums() -> None:
    assert epoch_running_loss(TP_2X2, 1, 4) == (16.0, 8)
    assert epoch_running_loss(TP_2X2, 2, 4) == (24.0, 8)


def test_another_world_size_counts_each_part_of_the_data_once() -> None:
    """One process resuming the tp run: 16 samples of mean loss 2.5, not 32."""
    assert epoch_running_loss(TP_2X2, 0, 1) == (40.0, 16)
    assert epoch_running_loss(TP_2X2, 1, 2) == (0.0, 0)  # rank 0 carries it


def test_a_checkpoint_without_its_leaders_counts_every_rank() -> None:
    """Checkpoints written before the leaders were recorded: every process held a part."""
    older = {k: v for k, v in TP_2X2.items() if k != "epoch_data_leaders"}
    assert epoch_running_loss(older, 0, 1) == (80.0, 32)
