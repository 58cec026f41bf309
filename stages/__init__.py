"""One module per stage; each exposes STAGE. Importing this package registers them in the catalogue
(pipeline/core/catalogue.py), which orders them by their declared inputs: a new stage module is listed here."""
from pipeline.core import catalogue
from stages import bundle, export, lite, server, system, train

catalogue.register(*(m.STAGE for m in (train, export, server, lite, bundle, system)))
