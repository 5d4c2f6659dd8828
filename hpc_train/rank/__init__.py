"""The rank side: what runs inside a job. The entry every rank runs (``entry``), the node agent that starts and
restarts a node's ranks (``agent``), bootstrap and groups (``distributed``), what every rank program stands on
(``runtime``), the built-in trainer and its engines (``train``), and a user's own function or script
(``program``). The login side never imports it."""
