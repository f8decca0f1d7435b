"""Data: arrays a caller passes, bound to a graph's input layers (`arrays`); datasets the workers
open themselves (`datasets`, `synthetic`); and a device reading only its part of each input tile
ahead of the step that needs it (`reading`).  This is where a dataset is read.

Imports `taskrt.ops`, `taskrt.graph` and `taskrt.gpu` below it."""
