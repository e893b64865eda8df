"""IPython's input history has one writer: rank 0 keeps the user's file, the others memory."""

from __future__ import annotations

from traitlets.config import Config

from dist_kernel.rank.kernel import history_in_memory


def test_rank_0_keeps_the_users_history_file() -> None:
    config = Config()
    assert not history_in_memory(config, "0")
    assert "hist_file" not in config.HistoryManager


def test_a_process_that_is_not_a_rank_keeps_the_users_history_file() -> None:
    config = Config()
    assert not history_in_memory(config, None)
    assert "hist_file" not in config.HistoryManager


def test_every_other_rank_keeps_its_history_in_memory() -> None:
    for rank in ("1", "7", "1023"):
        config = Config()
        assert history_in_memory(config, rank)
        assert config.HistoryManager.hist_file == ":memory:"


def test_the_rest_of_the_users_history_configuration_applies_on_every_rank() -> None:
    config = Config()
    config.HistoryManager.enabled = False
    config.HistoryManager.db_log_output = True
    config.HistoryManager.hist_file = "/home/user/my_history.sqlite"
    history_in_memory(config, "3")
    assert config.HistoryManager.enabled is False
    assert config.HistoryManager.db_log_output is True
    # a file of the user's own is rank 0's alone: shared, the ranks would take turns on it again
    assert config.HistoryManager.hist_file == ":memory:"
