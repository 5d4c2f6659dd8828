"""Why an attempt ended and what follows, for both sides: the ranks and their agents decide a retry with it, the
login node's ``status``, ``logs`` and follower explain with it. Failure classes from the run folder's evidence
(``evidence``, ``classify``, ``signal_deaths``, ``records``), the retry policy (``policy``), and a requeued
attempt's look-back (``recovery``). Never imports torch or DeepSpeed."""
