"""The checker the suite runs on headlab's typed modules (conftest.SHAPED): beartype, with PEP 484's
numeric tower (an int where a float is declared, as Python's own typing allows)."""

from beartype import BeartypeConf, beartype

checker = beartype(conf=BeartypeConf(is_pep484_tower=True))
