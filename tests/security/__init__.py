"""The hostile-input corpus: every login-node command fed inputs that try to run code, leak a secret, write
outside the run folder, hang, or crash; see harness.py for the checks every case shares."""
