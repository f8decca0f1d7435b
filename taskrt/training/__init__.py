"""Training: `Trainer` (`trainer`) and its parts, submitting steps and windows of steps (`steps`),
parameters and their placement (`placement`), snapshots and checkpoints (`snapshots`,
`checkpoint`), recovery from lost workers (`recovery`, `elastic`); epochs over datasets (`fit`);
the single-device reference trainer (`reference`) and independent subnet training (`ist`).

Imports every runtime room below it; never `taskrt.search` (what it needs from the search is handed
to it, as `Strategy.replan`)."""
