"""What several test modules share: processes seen from outside (``processes``), archives
of fake CIFAR-10 batches (``archives``). Importable as ``helpers`` because pytest puts
``tests/`` on ``sys.path`` for ``tests/conftest.py``."""
