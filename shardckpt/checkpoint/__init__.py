"""One checkpoint as files: writing, reading, verifying, tensor pieces, run directories and
``latest``, and the agreement of a job's ranks on a save or a load (``collective.py``). None of it
imports torch at import time; the collectives import it when a job calls them."""
