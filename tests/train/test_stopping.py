"""A stop signal that arrives while a step commits (its update, run state and metrics row) is held until
the commit is done, then stops the run as it would have; an error in the commit stops the run itself."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from rlfw.train.stopping import Terminated, handle_stop_signals, stop_deferred


@pytest.fixture
def run_handlers() -> Iterator[None]:
    """The handlers a run installs (SIGTERM -> Terminated, SIGINT -> KeyboardInterrupt), put back after."""
    previous = handle_stop_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("sig", "raised"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)], ids=["term", "int"]
)
@pytest.mark.usefixtures("run_handlers")
def test_a_signal_in_the_block_stops_the_run_when_the_block_has_ended(
    sig: signal.Signals, raised: type[BaseException]
) -> None:
    committed = []
    with pytest.raises(raised):
        with stop_deferred():
            signal.raise_signal(sig)
            committed.append("state")
            signal.raise_signal(sig)  # a second one changes nothing
            committed.append("row")
    assert committed == ["state", "row"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handlers are back


@pytest.mark.usefixtures("run_handlers")
def test_a_block_that_fails_stops_the_run_with_its_own_error() -> None:
    with pytest.raises(ValueError, match="the trainer failed"):
        with stop_deferred():
            signal.raise_signal(signal.SIGTERM)
            raise ValueError("the trainer failed")
    with stop_deferred():  # the held signal went with the error: nothing is delivered later
        pass


@pytest.mark.usefixtures("run_handlers")
def test_without_a_signal_the_block_runs_as_it_is() -> None:
    with stop_deferred():
        ran = True
    assert ran
    with pytest.raises(Terminated):  # and the run's handler is in force again
        signal.raise_signal(signal.SIGTERM)
