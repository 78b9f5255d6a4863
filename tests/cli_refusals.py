"""What a refused command must look like, for the tests that drive the CLI as a subprocess."""


def assert_one_line_refusal(done, *messages):
    """Exit 2, no traceback, one error line, holding each of ``messages``; returns ``done``."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for message in messages:
        assert message in errors[0], errors[0]
    return done
