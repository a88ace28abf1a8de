# test_signup.py
import signup

from questpie_celery.testing import Harness


def setup_function() -> None:
    signup.outbox.clear()


def test_signing_up_twice_welcomes_once(questpie_eager: Harness) -> None:
    first = signup.sign_up("usr_1", "ada@example.com")
    again = signup.sign_up("usr_1", "ada@example.com")
    assert first == again
    [welcome] = questpie_eager.dispatches(signup.send_welcome)
    assert (welcome.id, welcome.key, welcome.status) == (first, "welcome:usr_1", "completed")
    assert welcome.payload == {"user_id": "usr_1"}
    assert signup.outbox == ["link to ada@example.com", "welcome usr_1"]


def test_the_magic_link_stays_secret(questpie_eager: Harness) -> None:
    signup.sign_up("usr_2", "bob@example.com")
    [link] = questpie_eager.dispatches("send-magic-link")
    assert (link.secret, link.payload, link.status) == (True, None, "completed")


def test_a_timeout_is_retried(questpie_eager: Harness) -> None:
    signup.sign_up("flaky_3", "cy@example.com")
    [welcome] = questpie_eager.dispatches(signup.send_welcome)
    assert (welcome.status, welcome.attempts) == ("completed", 2)


def test_one_report_waits_at_a_time(questpie_ledger: Harness) -> None:
    reports = signup.questpie.queue.build_report
    assert reports.publish({"day": "mon"}) is not None
    assert reports.publish({"day": "tue"}) is None  # stately: the waiting slot is taken
    [waiting] = questpie_ledger.dispatches(reports)
    assert waiting.payload == {"day": "mon"} and not waiting.ended
    assert signup.outbox == []  # no worker, not eager: nothing ran


def test_a_worker_sends_the_welcome(questpie_worker: Harness) -> None:
    dispatch_id = signup.sign_up("usr_4", "dee@example.com")
    assert questpie_worker.wait_for(dispatch_id).status == "completed"
    assert sorted(signup.outbox) == ["link to dee@example.com", "welcome usr_4"]
