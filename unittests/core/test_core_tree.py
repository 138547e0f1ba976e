"""``core.tree``: argument trees flatten into leaves and a hashable spec (the signature key holds
the spec as it is), and rebuild from them."""
from collections import namedtuple

from paddle_graphpp.core.lifecycle import SignatureKey
from paddle_graphpp.core.tree import flatten, unflatten

Pair = namedtuple("Pair", "a b")


def test_specs_are_hashable_equal_for_equal_structures_and_rebuild_the_arguments():
    args = ((1, [2, 3], {"x": 4, "y": (5, Pair(6, 7))}), {"k": None})
    leaves, spec = flatten(args)
    assert leaves == [1, 2, 3, 4, 5, 6, 7, None]
    assert unflatten(spec, leaves) == args and type(unflatten(spec, leaves)[0][2]["y"][1]) is Pair
    same = flatten(((0, [0, 0], {"x": 0, "y": (0, Pair(0, 0))}), {"k": 0}))[1]
    assert hash(spec) == hash(same) and spec == same  # leaves' values are not part of the spec
    others = [((1, [2, 3], {"y": 4, "x": (5, Pair(6, 7))}), {"k": None}),  # other dict keys
              ((1, (2, 3), {"x": 4, "y": (5, Pair(6, 7))}), {"k": None}),  # a tuple for a list
              ((1, [2, 3], {"x": 4, "y": (5, (6, 7))}), {"k": None}),  # a tuple for a named tuple
              ((1, [2, 3, 0], {"x": 4, "y": (5, Pair(6, 7))}), {"k": None})]  # one more leaf
    assert len({spec, *(flatten(o)[1] for o in others)}) == 5


class Counted:
    hashed = 0

    def __hash__(self):
        Counted.hashed += 1
        return 7


def test_a_signature_key_is_a_tuple_that_hashes_its_parts_once():
    Counted.hashed = 0
    part = Counted()
    parts = (("spec",), (1, 2), part)
    key = SignatureKey(parts)
    assert Counted.hashed == 1
    for _ in range(3):
        hash(key)
        assert {key: "found"}[key] == "found"
    assert Counted.hashed == 1  # the engine's tables look the same key up many times per call
    assert key == parts and hash(key) == hash(parts) and key[1] == (1, 2)
    assert {parts: "found"}[key] == "found"


def test_a_pickled_signature_key_is_hashed_anew_where_it_is_loaded():
    import pickle

    key = SignatureKey((("leaf",), ("str", "use_cache")))
    key._hash = 12345  # as if hashed in another process, where strings hash differently
    loaded = pickle.loads(pickle.dumps(key))
    assert loaded == key and type(loaded) is SignatureKey
    assert hash(loaded) == tuple.__hash__(loaded)  # computed on load, not carried over
    assert {tuple(loaded): "found"}.get(loaded) == "found"


def test_a_spec_from_another_process_rebuilds_too():
    import pickle

    args = ((1, "a"), {"emb": Pair(2, 3), "mask": None, "deep": [4, (5, [6])], "empty": ()}, [], 7)
    leaves, spec = flatten(args)
    loaded = pickle.loads(pickle.dumps(spec))  # its leaf specs are equal tuples, not the same objects
    assert loaded == spec and unflatten(loaded, list(leaves)) == args


def test_a_lone_leaf_and_a_mapping_read_as_its_items_are_read():
    for leaf in (None, 3, "x", object()):
        leaves, spec = flatten(leaf)
        assert leaves == [leaf] and unflatten(spec, leaves) is leaf

    class Computed(dict):
        def __getitem__(self, key):
            return ("via getitem", super().__getitem__(key))

    leaves, spec = flatten(Computed(a=1))
    assert leaves == ["via getitem", 1]  # the tuple its item access returned, flattened
    assert unflatten(spec, leaves) == {"a": ("via getitem", 1)}
