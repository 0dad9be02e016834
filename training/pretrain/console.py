"""What Lightning puts on the screen during `rmm pretrain`: one line per event, nothing else.

Lightning gives its loggers handlers of their own (`lightning` always, `lightning.pytorch` when it is
imported before the application set up logging), so once the application's root handler exists
too, records print twice (`INFO: …` and `INFO lightning.pytorch…: …`). It also logs
advertisements for its cloud products, and its pytree helper trips a torch deprecation the user
cannot act on. `lightning_console` routes Lightning's records through exactly one handler (the
application's when it has one, else Lightning's own), drops the advertisements, and silences that
one warning, restoring everything afterwards.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ADVERTISEMENT_PREFIX", "lightning_console"]

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")  # each may hold a handler of its own
# where Lightning's rank_zero_info/warn create their records (logger filters see only those)
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
ADVERTISEMENT_PREFIX = "💡 Tip"
# torch ≥ 2.10 deprecates the LeafSpec class that Lightning 2.6's own _pytree helper instantiates
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _NoAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().lstrip().startswith(ADVERTISEMENT_PREFIX)


@contextmanager
def lightning_console() -> Iterator[None]:
    """Within the block, every Lightning log record reaches the screen at most once, without
    advertisements or the LeafSpec deprecation; handlers, propagation and filters are restored after."""
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    saved = [(logger, list(logger.handlers), logger.propagate) for logger in loggers]
    if logging.getLogger().handlers:  # the application logs: Lightning's records go through it only
        for logger in loggers:
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.propagate = True
    advertisements = _NoAdvertisements()
    sources = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS]
    for source in sources:
        source.addFilter(advertisements)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)
            yield
    finally:
        for source in sources:
            source.removeFilter(advertisements)
        for logger, handlers, propagate in saved:
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            for handler in handlers:
                logger.addHandler(handler)
            logger.propagate = propagate
