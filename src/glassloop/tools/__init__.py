"""Commands built on the loop: export, prediction from files, the learning-rate finder, the doctor's
checklist, verify-resume, a run's evaluation and report."""
