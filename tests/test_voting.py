"""Vote kernel, topologies, rewards and metrics of corl_jax.voting against a plain-Python transcription of the
reference (co_rl_reference.md §1.5-1.9, §4.1-4.2, §5.1-5.2, §7.4, §9)."""

import collections
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corl_jax import voting
from corl_jax.voting import NO_ANSWER, Interner, PairGrader

SENTINEL = "\x00__unlabeled__\x00"  # the reference's _UNLABELED_SENTINEL

# ----------------------------------------------------------------------------------------------------------------
# Plain-Python transcription of the reference functions (independent of the kernel).


def ref_majority_vote(keys, threshold):
    """co_label_utils._majority_vote."""
    valid = [k for k in keys if k is not None]
    if not valid:
        return None, 0.0
    key, count = collections.Counter(valid).most_common(1)[0]
    top_freq = count / len(valid)
    return (None, top_freq) if top_freq < threshold else (key, top_freq)


def ref_peer_majority_vote(peer_labels):
    """co_rl_trainer._peer_majority_vote."""
    labeled = [x for x in peer_labels if x != SENTINEL]
    if not labeled:
        return SENTINEL
    top = collections.Counter(labeled).most_common(2)
    if len(top) == 2 and top[0][1] == top[1][1]:
        return SENTINEL
    return top[0][0]


def ref_peers(a, n):
    """`--peers` of agent a: the other agents in ring order starting at its successor (A: B,C; B: C,A; C: A,B)."""
    return [(a + k) % n for k in range(1, n)]


def ref_supervision(my, a, p, topology, gt):
    if topology in ("pair", "ring"):
        return my[ref_peers(a, len(my))[0]][p]  # teacher = peers[0]
    if topology == "peer_majority":
        return ref_peer_majority_vote([my[b][p] for b in ref_peers(a, len(my))])
    if topology == "self":
        return my[a][p]
    return gt[p]


def ref_step(texts_by_agent, gt, topology, threshold, extract, normalize, grade):
    """The reference's step: vote keys, per-agent vote with sentinel, supervision, reward loop (§1.13)."""
    n_prompts = len(gt)
    g = len(texts_by_agent[0]) // n_prompts
    my = []
    for texts in texts_by_agent:
        keys = [normalize(extract(t)) or None for t in texts]
        my.append([ref_majority_vote(keys[p * g:(p + 1) * g], threshold)[0] or SENTINEL for p in range(n_prompts)])
    rewards, sups = [], []
    for a, texts in enumerate(texts_by_agent):
        sup = [ref_supervision(my, a, p, topology, gt) for p in range(n_prompts)]
        sups.append(sup)
        # GT-Reward with a missing gold answer (None) has no reference behaviour; ours gives 0.
        rewards.append([[1.0 if s is not None and grade(extract(texts[p * g + k]), s) else 0.0 for k in range(g)]
                        for p, s in enumerate(sup)])
    return my, sups, rewards


# Toy answer rules with the shape of the real ones: extraction may give "", vote keys are exact strings after a
# light normalization, and the grader is more lenient than key equality (0.5 == 1/2 == half, as the sympy grader).
def toy_extract(text):
    return text.rsplit("=", 1)[1].strip() if "=" in text else ""


def toy_normalize(s):
    return None if s is None else s.strip().lower()


def toy_grade(pred, gold):
    canon = {"0.5": "1/2", "half": "1/2", ".5": "1/2"}
    p, g = toy_normalize(pred), toy_normalize(gold)
    return bool(p) and canon.get(p, p) == canon.get(g, g)


TEXTS = ["so x = 1", "x = 1 ", "then = 0.5", "= 1/2", "= half", "= 2", "= B", "= b", "no answer", "=", "x = 3"]
GOLDS = ["1", "1/2", "0.5", "b", "7", " 2", None]
THRESHOLDS = st.sampled_from([0.0, 0.25, 1 / 3, 0.33333334, 0.5, 0.6, 2 / 3, 0.75, 1.0]) | st.floats(0.0, 1.0)
SHAPES = st.tuples(st.integers(2, 5), st.sampled_from([1, 3]), st.sampled_from([1, 4, 8]))  # few jit shapes


def strings(table, ids):
    return [[table.lookup(i) for i in row] for row in np.asarray(ids).tolist()]


def sentinel_to_none(rows):
    return [[None if x == SENTINEL else x for x in row] for row in rows]


# ----------------------------------------------------------------------------------------------------------------
# §7.4 cases


@pytest.mark.parametrize("keys, threshold, expected", [
    (["1", "1", "2", None], 0.0, ("1", 2 / 3)),
    (["1", "2", None, None], 0.0, ("1", 0.5)),  # tie -> first seen
    (["2", "1", "1", "2"], 0.0, ("2", 0.5)),
    (["1", "2", "3", "1"], 0.6, (None, 0.5)),
    (["1", "2", "2", "1"], 0.5, ("1", 0.5)),  # 0.5 is not < 0.5
    ([None, None], 0.0, (None, 0.0)),
])
def test_majority_vote_reference_cases(keys, threshold, expected):
    table = Interner()
    labels, top_freq = voting.vote(table.intern_all(keys)[None, None], threshold)
    assert table.lookup(int(labels[0, 0])) == expected[0]
    assert float(top_freq[0, 0]) == pytest.approx(expected[1], abs=1e-6)


@pytest.mark.parametrize("threshold, expected", [(1 / 3, 0), (0.33333334, NO_ANSWER), (0.3333333, 0)])
def test_threshold_is_compared_as_the_reference_does_in_float64(threshold, expected):
    # 1 vote of 3: the reference tests 1/3 < threshold in float64; float32(1/3) == float32(0.33333334).
    labels, _ = voting.vote(np.array([[[0, 1, 2]]]), threshold)
    assert int(labels[0, 0]) == expected


@pytest.mark.parametrize("peer_labels, expected", [
    (["x", "y"], None), (["x", None], "x"), ([None, None], None), (["x", "x", "y"], "x"), (["x", "y", "z"], None),
])
def test_peer_majority_reference_cases(peer_labels, expected):
    table = Interner()
    labels = table.intern_all(["me"] + peer_labels)[:, None]  # agent 0's peers are all the others
    assert table.lookup(int(voting.teacher_labels(labels, "peer_majority")[0, 0])) == expected


def test_ring_of_three_is_the_reference_launcher():
    # n3 ring launcher: A --peers B,C; B --peers C,A; C --peers A,B; teacher = peers[0] => A<-B, B<-C, C<-A.
    launcher_teacher = {"A": "B", "B": "C", "C": "A"}
    table = Interner()
    labels = table.intern_all(["A", "B", "C"])[:, None]
    teachers = strings(table, voting.teacher_labels(labels, "ring"))
    assert {name: t[0] for name, t in zip("ABC", teachers)} == launcher_teacher


def test_pair_is_mutual():
    labels = np.array([[0, -1, 2], [1, 3, -1]])
    np.testing.assert_array_equal(voting.teacher_labels(labels, "pair"), labels[::-1])
    np.testing.assert_array_equal(voting.teacher_labels(labels, "ring"), labels[::-1])


# ----------------------------------------------------------------------------------------------------------------
# Property tests of the kernel against the reference


@st.composite
def answer_ids(draw):
    n, p, g = draw(SHAPES)
    ids = draw(st.lists(st.integers(-1, 3), min_size=n * p * g, max_size=n * p * g))
    return np.array(ids, np.int32).reshape(n, p, g)


@settings(max_examples=100, deadline=None)
@given(answer_ids(), THRESHOLDS)
def test_vote_matches_reference(ids, threshold):
    labels, top_freq = voting.vote(ids, threshold)
    for a in range(ids.shape[0]):
        for p in range(ids.shape[1]):
            keys = [None if i < 0 else int(i) for i in ids[a, p]]
            label, freq = ref_majority_vote(keys, threshold)
            assert int(labels[a, p]) == (NO_ANSWER if label is None else label)
            assert float(top_freq[a, p]) == pytest.approx(freq, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(answer_ids(), st.sampled_from(voting.TOPOLOGIES), st.data())
def test_teacher_labels_match_reference(ids, topology, data):
    labels = ids[..., 0]  # any [A, P] ids with holes
    n, n_prompts = labels.shape
    if topology == "pair" and n != 2:
        topology = "ring"
    gt = np.array(data.draw(st.lists(st.integers(-1, 3), min_size=n_prompts, max_size=n_prompts)), np.int32)
    teacher = np.asarray(voting.teacher_labels(labels, topology, gt))
    my = [[SENTINEL if i < 0 else int(i) for i in row] for row in labels.tolist()]
    gt_ref = [None if i < 0 else int(i) for i in gt.tolist()]
    for a in range(n):
        for p in range(n_prompts):
            expected = ref_supervision(my, a, p, topology, gt_ref)
            assert int(teacher[a, p]) == (NO_ANSWER if expected in (SENTINEL, None) else expected)


@st.composite
def steps(draw):
    n, n_prompts, g = draw(SHAPES)
    topology = draw(st.sampled_from(voting.TOPOLOGIES))
    if topology == "pair" and n != 2:
        topology = "ring"
    texts = [draw(st.lists(st.sampled_from(TEXTS), min_size=n_prompts * g, max_size=n_prompts * g))
             for _ in range(n)]
    gt = draw(st.lists(st.sampled_from(GOLDS), min_size=n_prompts, max_size=n_prompts))
    return texts, gt, topology, draw(THRESHOLDS)


@settings(max_examples=80, deadline=None)
@given(steps())
def test_score_step_matches_reference(step):
    texts, gt, topology, threshold = step
    calls = []
    grader = PairGrader(lambda pred, gold: calls.append((pred, gold)) or toy_grade(pred, gold))
    result = voting.score_step(texts, gt, topology=topology, threshold=threshold, grader=grader,
                               extract=toy_extract, normalize=toy_normalize, step=7, prompt_ids=range(len(gt)))
    my, sups, rewards = ref_step(texts, gt, topology, threshold, toy_extract, toy_normalize, toy_grade)
    assert result.labels == sentinel_to_none(my)
    assert result.teacher_labels == sentinel_to_none(sups)
    np.testing.assert_array_equal(result.rewards, np.array(rewards, np.float32))
    assert result.rewards.dtype == np.float32
    # Grading is paid once per distinct (pred, label) pair, and only for labeled prompts.
    g = result.rewards.shape[-1]
    needed = {(toy_extract(texts[a][p * g + k]), sups[a][p]) for a in range(len(texts)) for p in range(len(gt))
              for k in range(g) if sups[a][p] not in (SENTINEL, None)}
    if topology == "self":
        needed |= {(label, gold) for row in result.labels for label, gold in zip(row, gt) if None not in (label, gold)}
    assert len(calls) == len(set(calls)) and set(calls) == needed


# ----------------------------------------------------------------------------------------------------------------
# Edge cases


def score(texts, gt, topology="ring", threshold=0.0, grader=None, names=None):
    return voting.score_step(texts, gt, topology=topology, threshold=threshold,
                             grader=grader or PairGrader(toy_grade), extract=toy_extract, normalize=toy_normalize,
                             step=3, prompt_ids=[f"q{i}" for i in range(len(gt))], agent_names=names)


@pytest.mark.parametrize("topology", ["ring", "peer_majority", "self"])
def test_all_unlabeled_gives_zero_rewards_no_grading_and_zero_metrics(topology):
    def never(pred, gold):
        raise AssertionError("graded an unlabeled prompt")

    result = score([["no answer", "="] * 2, ["=", "no"] * 2, ["= ", "x"] * 2], ["1", "2"], topology,
                   grader=PairGrader(never))
    assert result.labels == result.teacher_labels == [[None, None]] * 3
    assert not result.rewards.any()
    for m in result.metrics.values():
        assert all(v == 0.0 for k, v in m.items() if k != "co_labeling/peer_tie_rate")
        assert m["co_labeling/peer_tie_rate"] == 0.0  # no prompt with all peers labeled


def test_unlabeled_teacher_zeroes_only_its_student():
    # Only C is labeled (A has no answer, B's 1:1 split is under the threshold): in the ring A<-B, B<-C, C<-A, so
    # only B is rewarded (against C's "1").
    result = score([["no answer", "="] * 2, ["= 1", "= 2"] * 2, ["x = 1", "x = 1"] * 2], ["1", "2"],
                   threshold=0.6)
    assert result.labels == [[None, None], [None, None], ["1", "1"]]
    assert result.teacher_labels == [[None, None], ["1", "1"], [None, None]]
    np.testing.assert_array_equal(result.rewards[1], [[1, 0], [1, 0]])
    assert result.rewards[0].sum() == result.rewards[2].sum() == 0.0


def test_threshold_one_needs_unanimity():
    result = score([["= 1", "= 1", "= 1", "= 2"], ["= 1", "= 1", "=", "= 1"]], ["1", "1"], "pair", threshold=1.0)
    assert result.labels == [["1", None], ["1", "1"]]  # unparseable rollouts do not count against unanimity
    np.testing.assert_array_equal(result.rewards[1], [[1, 1], [0, 0]])  # B's teacher A is unlabeled on prompt 1


def test_ground_truth_grades_against_the_raw_gold_string():
    calls = []
    grader = PairGrader(lambda p, g: calls.append((p, g)) or toy_grade(p, g))
    result = score([["= half", "= 0.5", "= 2", "="]], [" 0.5 ", None], "ground_truth", grader=grader)
    assert result.teacher_labels == [[" 0.5 ", None]]  # not normalized (§4.1); missing gold = unlabeled
    np.testing.assert_array_equal(result.rewards, [[[1, 1], [0, 0]]])
    assert set(calls) == {("half", " 0.5 "), ("0.5", " 0.5 ")}


def test_self_is_ttrl_with_its_metrics():
    result = score([["= 0.5", "= 0.5", "= 1/2", "= 3", "=", "="]], ["1/2", "7", "1"], "self",
                   names=["solo"])
    assert result.teacher_labels == result.labels == [["0.5", "1/2", None]]
    np.testing.assert_array_equal(result.rewards[0], [[1, 1], [1, 0], [0, 0]])
    m = result.metrics["solo"]
    assert m["self_labeling/fraction_labeled"] == pytest.approx(2 / 3)
    assert m["self_labeling/parseable_fraction"] == pytest.approx(4 / 6)
    assert m["self_labeling/top_frequency_mean"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["self_labeling/pseudo_label_matches_gt"] == pytest.approx(1 / 2)  # grader: 0.5 == 1/2; 1/2 != 7
    assert m["co_labeling/oracle_accuracy_me"] == 0.0  # string equality: "0.5" != "1/2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(topology="pair"), "exactly 2 agents"),
    (dict(topology="star"), "unknown topology"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=math.nan), "threshold"),
])
def test_bad_configuration_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        score([["= 1"], ["= 1"], ["= 2"]], ["1"], **kwargs)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="same number of completions"):
        score([["= 1", "= 2"], ["= 1"]], ["1"])
    with pytest.raises(ValueError, match="G per prompt"):
        score([["= 1", "= 2", "= 3"]] * 2, ["1", "2"])
    with pytest.raises(ValueError, match="one prompt id per prompt"):
        voting.score_step([["= 1"]], ["1"], topology="self", threshold=0.0, grader=PairGrader(toy_grade),
                          extract=toy_extract, normalize=toy_normalize, step=0, prompt_ids=[])
    with pytest.raises(ValueError, match="gt_ids"):
        voting.teacher_labels(np.zeros((2, 3), np.int32), "ground_truth")
    with pytest.raises(ValueError, match="at least 2 agents"):
        voting.teacher_labels(np.zeros((1, 3), np.int32), "ring")
    with pytest.raises(ValueError, match="integer array"):
        voting.vote(np.zeros((2, 3)), 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Interning, grading cache, rewards gather


def test_interner_is_dense_first_seen_and_round_trips():
    table = Interner()
    ids = table.intern_all(["b", None, "a", "b", ""])
    np.testing.assert_array_equal(ids, [0, NO_ANSWER, 1, 0, 2])
    assert ids.dtype == np.int32 and len(table) == 3
    assert [table.lookup(i) for i in ids.tolist()] == ["b", None, "a", "b", ""]
    with pytest.raises(TypeError, match="str or None"):
        table.intern(3)


def test_answer_ids_are_shared_across_agents():
    result = score([["= x", "= y"], ["= y", "= x"]], ["x", "y"], "pair")
    assert result.labels == [["x", "y"], ["y", "x"]]
    assert result.teacher_labels == [["y", "x"], ["x", "y"]]


def test_pair_grader_caches_across_steps_and_evicts_oldest():
    calls = []
    grader = PairGrader(lambda p, g: calls.append((p, g)) or p == g, max_entries=2)
    assert [grader("1", "1"), grader("1", "2"), grader("1", "1")] == [True, False, True]
    assert (grader.hits, grader.misses, calls) == (1, 2, [("1", "1"), ("1", "2")])
    grader("3", "3")  # evicts the least recently used entry, ("1", "2")
    grader("1", "2")
    assert calls[-1] == ("1", "2") and grader.misses == 4


def test_reward_pairs_and_gather():
    pred = np.array([[[0, 1, 0], [2, 2, 0]]])
    teacher = np.array([[5, -1]])
    pairs, index = voting.reward_pairs(pred, teacher)
    np.testing.assert_array_equal(pairs, [[0, 5], [1, 5]])
    np.testing.assert_array_equal(index, [[[0, 1, 0], [-1, -1, -1]]])
    np.testing.assert_array_equal(voting.gather_rewards(np.array([1.0, 0.0]), index), [[[1, 0, 1], [0, 0, 0]]])


# ----------------------------------------------------------------------------------------------------------------
# Metrics and error overlap, hand-checked


def test_co_labeling_metrics_two_agents():
    # prompts:          0     1     2     3
    texts = [["= 1", "= 2", "=", "= 4"], ["= 1", "= 3", "= 9", "="]]
    result = score(texts, ["1", "3", None, "4"], "pair", names=["A", "B"])
    a, b = result.metrics["A"], result.metrics["B"]
    assert a == {"co_labeling/labeled_fraction_me": 0.75, "co_labeling/oracle_accuracy_me": 2 / 3,
                 "co_labeling/peer_agreement": 0.5, "co_labeling/labeled_fraction_peer": 0.75,
                 "co_labeling/both_labeled_fraction": 0.5}
    assert b["co_labeling/oracle_accuracy_me"] == 2 / 3 and b["co_labeling/peer_agreement"] == 0.5


def test_co_labeling_metrics_three_agents_ring():
    # prompt:             0      1      2      3
    my = [["= 1", "= 2", "= 5", "="],      # A
          ["= 1", "= 3", "=",   "= 4"],    # B
          ["= 1", "= 2", "= 5", "= 4"]]    # C
    result = score(my, ["1", "2", "5", None], "ring", names=["A", "B", "C"])
    a = result.metrics["A"]  # A's teacher is B; peers in ring order B, C
    assert a["co_labeling/labeled_fraction_me"] == 0.75
    assert a["co_labeling/oracle_accuracy_me"] == 1.0
    assert a["co_labeling/peer_agreement/B"] == 0.5  # both labeled on 0, 1: agree on 0
    assert a["co_labeling/peer_agreement/C"] == 1.0
    assert a["co_labeling/labeled_fraction_peer/B"] == 0.75 and a["co_labeling/labeled_fraction_peer/C"] == 1.0
    assert a["co_labeling/supervision_fraction"] == 0.75
    assert a["co_labeling/peer_tie_rate"] == 0.0
    assert a["co_labeling/unanimous_rate"] == 0.5  # me and all peers labeled on 0, 1; unanimous on 0
    assert a["co_labeling/supervision_contains_truth"] == 0.5  # supervised with truth on 0, 1: B right on 0
    c = result.metrics["C"]  # C's teacher is A (labeled on 0, 1, 2); truth known on 0, 1, 2
    assert c["co_labeling/supervision_contains_truth"] == 1.0
    assert {"co_labeling/peer_agreement/A", "co_labeling/peer_agreement/B"} <= set(c) and len(a) == len(c) == 10


def test_peer_tie_rate_under_peer_majority():
    result = score([["= 1"], ["= 2"], ["= 3"]], ["1"], "peer_majority")
    assert result.teacher_labels == [[None], [None], [None]]
    assert all(m["co_labeling/peer_tie_rate"] == 1.0 for m in result.metrics.values())


def test_records_are_plain_and_complete():
    result = score([["= 1", "= 1"], ["= 2", "="]], ["1"], "pair", names=["A", "B"])
    assert result.records == [
        {"step": 3, "prompt_id": "q0", "agent": "A", "label": "1", "teacher_label": "2", "gt": "1", "gt_key": "1",
         "rewards": [0.0, 0.0], "top_freq": 1.0},
        {"step": 3, "prompt_id": "q0", "agent": "B", "label": "2", "teacher_label": "1", "gt": "1", "gt_key": "1",
         "rewards": [0.0, 0.0], "top_freq": 1.0},
    ]


def test_cohens_kappa_hand_computed():
    # p_o = 3/4, p_i = 1/2, p_j = 1/4, p_e = 1/8 + 3/8 = 1/2 -> kappa = (3/4 - 1/2) / (1/2) = 1/2
    assert voting.cohens_kappa([1, 1, 0, 0], [1, 0, 0, 0]) == pytest.approx(0.5)
    assert voting.cohens_kappa([1, 0, 1, 0], [1, 0, 1, 0]) == pytest.approx(1.0)
    assert voting.cohens_kappa([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)
    # p_o = 1/2 (prompts 0, 3), p_i = p_j = 1/2: p_e = 1/2 -> kappa = 0 (chance agreement)
    assert voting.cohens_kappa([1, 1, 0, 0], [1, 0, 1, 0]) == pytest.approx(0.0)
    # p_o = 1/4, p_i = 1/2, p_j = 3/4: p_e = 3/8 + 1/8 = 1/2 -> kappa = (1/4 - 1/2) / (1/2) = -1/2
    assert voting.cohens_kappa([1, 1, 0, 0], [1, 0, 1, 1]) == pytest.approx(-0.5)
    assert math.isnan(voting.cohens_kappa([1, 1], [1, 1]))
    with pytest.raises(ValueError, match="equal length"):
        voting.cohens_kappa([1, 0], [1])


def test_error_overlap_hand_computed():
    truths = ["1", "2", "3", "4", None]
    labels_i = ["1", "5", "7", None, "9"]
    labels_j = ["1", "5", "3", None, "9"]  # last prompt has no truth: skipped
    out = voting.error_overlap(labels_i, labels_j, truths)
    # right_i = 1000, right_j = 1010: p_o = 3/4, p_e = 1/4*1/2 + 3/4*1/2 = 1/2 -> kappa 1/2
    assert out["kappa"] == pytest.approx(0.5)
    assert out["p_both_wrong"] == pytest.approx(2 / 4)  # prompts 1 and 3
    assert out["p_both_wrong_same"] == pytest.approx(1 / 4)  # prompt 1 ("5"); unlabeled is no shared answer


def test_real_math_answers_reward_equivalent_forms_across_vote_buckets():
    # §1.9: the label is the teacher's vote key, equivalence at reward time is the (lenient) grader.
    from corl_jax.answers import math as math_answers

    texts = [["so $\\boxed{\\frac{3}{4}}$", "thus \\boxed{\\dfrac{3}{4}}", "I give up", "the answer is 2"],
             ["we get 0.75", "\\boxed{3/4}", "\\boxed{}", "No numbers here"]]
    result = voting.score_step(texts, ["\\frac{3}{4}", "2"], topology="pair", threshold=0.0,
                               grader=PairGrader(math_answers.grade_answer), extract=math_answers.extract_answer,
                               normalize=math_answers.normalize_answer, step=0, prompt_ids=[0, 1])
    assert result.labels == [["\\frac{3}{4}", "2"], ["0.75", None]]  # "0.75" and "\frac{3}{4}" tie: first seen
    np.testing.assert_array_equal(result.rewards, [[[1, 1], [0, 0]], [[1, 1], [0, 0]]])
    assert [[math_answers.vote_key(t) for t in agent] for agent in texts] == [
        ["\\frac{3}{4}", "\\frac{3}{4}", None, "2"], ["0.75", "\\frac{3}{4}", None, None]]
