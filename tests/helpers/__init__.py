"""What several test modules share: the command line run in a new process or this one
(``cli``), processes seen from outside (``processes``), archives of fake CIFAR-10 batches
(``archives``). Importable as ``helpers`` because pytest puts ``tests/`` on ``sys.path`` for
``tests/conftest.py``."""
