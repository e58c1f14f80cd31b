"""@subscribe, collecting handlers, handler signature inspection, group/pattern checks."""

import types
import typing

import pytest

from eventflow import App, ConfigurationError, Context, Envelope, Event, RetryPolicy, subscribe
from eventflow.groups import GroupSpec
from eventflow.subscribe import DEFAULT_TIMEOUT, collect_handlers, inspect_handler


class Alpha(Event, type="ut.sub.alpha"):
    a: int


class Beta(Event, type="ut.sub.beta", version=2):
    b: str


class AlphaV2(Event, type="ut.sub.alpha", version=2):
    a: int


# -- the decorator -----------------------------------------------------------------------------


def test_subscribe_marks_and_returns_the_function() -> None:
    async def handler(event: Alpha, ctx: Context) -> None: ...

    marked = subscribe("ut.sub.alpha", group="g", concurrency=4, timeout=2.5)(handler)
    assert marked is handler
    (spec,) = collect_handlers([handler])
    assert spec.fn is handler
    assert spec.pattern == "ut.sub.alpha"
    assert spec.group == "g"
    assert spec.concurrency == 4
    assert spec.timeout == 2.5
    assert spec.dead_letter is True
    assert spec.idempotent is True
    assert isinstance(spec.retry, RetryPolicy)
    assert spec.name.endswith("handler")


def test_subscribe_defaults() -> None:
    @subscribe("ut.sub.alpha")
    async def handler(event: Alpha) -> None: ...

    (spec,) = collect_handlers([handler])
    assert spec.group is None  # the app's name at wiring time
    assert spec.concurrency == 1
    assert spec.timeout == DEFAULT_TIMEOUT
    assert spec.retry.max_attempts == RetryPolicy().max_attempts
    assert spec.start == "latest"


def test_subscribe_takes_where_a_new_group_begins() -> None:
    @subscribe("ut.sub.alpha", group="g", start="earliest")
    async def handler(event: Alpha) -> None: ...

    (spec,) = collect_handlers([handler])
    assert spec.start == "earliest"
    app = App("ut-sub-start", handlers=[handler])
    assert app.subscriptions == (GroupSpec("g", "ut.sub.alpha", "earliest"),)


def test_stacked_decorators_give_two_subscriptions() -> None:
    @subscribe("ut.sub.alpha", group="one")
    @subscribe("ut.sub.beta", group="two")
    async def handler(event: Alpha | Beta) -> None: ...

    specs = collect_handlers([handler])
    assert {(s.pattern, s.group) for s in specs} == {
        ("ut.sub.alpha", "one"),
        ("ut.sub.beta", "two"),
    }


def test_subscribe_registers_nothing_globally() -> None:
    @subscribe("ut.sub.alpha", group="lonely")
    async def handler(event: Alpha) -> None: ...

    app = App("ut-sub-empty")
    assert app.groups == ()


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("ut..x",), {}, "invalid pattern"),
        (("ut.sub.a>",), {}, "invalid pattern"),
        (("ut.sub.alpha",), {"concurrency": 0}, "concurrency"),
        (("ut.sub.alpha",), {"timeout": 0}, "timeout"),
        (("ut.sub.alpha",), {"timeout": -1.0}, "timeout"),
        (("ut.sub.alpha",), {"retry": "3"}, "retry"),
        (("ut.sub.alpha",), {"start": "oldest"}, "start must be 'latest' or 'earliest'"),
        (("ut.sub.alpha",), {"start": None}, "start must be 'latest' or 'earliest'"),
    ],
)
def test_subscribe_rejects_bad_arguments(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        subscribe(*args, **kwargs)


def test_bare_subscribe_without_pattern_says_how_to_write_it() -> None:
    with pytest.raises(ConfigurationError) as info:

        @subscribe  # type: ignore[arg-type]  # the mistake under test
        async def handler(event: Alpha) -> None: ...

    text = str(info.value)
    assert "without its topic pattern" in text
    assert "handler" in text
    assert '@subscribe("topic.pattern", ...)' in text


@pytest.mark.parametrize("pattern", [42, None, b"ut.sub.alpha", ["ut.sub.alpha"]])
def test_non_string_patterns_are_refused(pattern: object) -> None:
    with pytest.raises(ConfigurationError, match="pattern as a string"):
        subscribe(pattern)  # type: ignore[arg-type]


@pytest.mark.parametrize("retry", [0, -1, -5])
def test_subscribe_refuses_retry_below_one(retry: int) -> None:
    with pytest.raises(ConfigurationError) as info:
        subscribe("ut.sub.alpha", retry=retry)
    text = str(info.value)
    assert f"retry={retry}" in text
    assert "retry=1" in text  # says what to write for a single attempt


def test_subscribe_needs_an_async_function() -> None:
    def sync_handler(event: Alpha) -> None: ...

    with pytest.raises(ConfigurationError, match="async def"):
        subscribe("ut.sub.alpha")(sync_handler)


# -- collecting --------------------------------------------------------------------------------


def make_module(name: str, **members: object) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in members.items():
        setattr(module, key, value)
    return module


def test_collect_from_modules_and_functions() -> None:
    @subscribe("ut.sub.alpha", group="m1")
    async def one(event: Alpha) -> None: ...

    @subscribe("ut.sub.beta", group="m2")
    async def two(event: Beta) -> None: ...

    async def unmarked(event: Alpha) -> None: ...

    @subscribe("ut.sub.alpha", group="f")
    async def three(event: Alpha) -> None: ...

    module = make_module("ut_sub_handlers", one=one, two=two, unmarked=unmarked, CONST=3)
    specs = collect_handlers([module, three])
    assert [s.fn for s in specs] == [one, two, three]
    app = App("ut-sub-app", handlers=[module, three])
    assert set(app.groups) == {"m1", "m2", "f"}


def test_module_without_handlers_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match="no @subscribe functions"):
        collect_handlers([make_module("ut_sub_empty", x=1)])


@pytest.mark.parametrize("item", [42, "pkg.mod:handler", None])
def test_unmarked_items_are_errors(item: object) -> None:
    with pytest.raises(ConfigurationError, match="not a @subscribe function"):
        collect_handlers([item])


def test_unmarked_function_is_an_error() -> None:
    async def plain(event: Alpha) -> None: ...

    with pytest.raises(ConfigurationError, match="decorate it"):
        App("ut-sub-plain", handlers=[plain])


# -- signature inspection ----------------------------------------------------------------------


async def by_class(event: Alpha, ctx: Context) -> None: ...


async def by_class_no_ctx(event: Beta) -> None: ...


async def by_pep604_union(event: Alpha | Beta, ctx: Context) -> None: ...


async def by_typing_union(event: typing.Union[Alpha, Beta]) -> None: ...  # noqa: UP007


async def by_envelope(env: Envelope, ctx: Context) -> None: ...


async def by_any_event(event: Event) -> None: ...


def test_event_class_annotation() -> None:
    sig = inspect_handler(by_class)
    assert sig.accepts == {"ut.sub.alpha": Alpha}
    assert sig.takes_context is True
    assert sig.any_event is False
    assert inspect_handler(by_class_no_ctx).takes_context is False


@pytest.mark.parametrize("fn", [by_pep604_union, by_typing_union])
def test_union_annotation(fn: typing.Any) -> None:
    assert inspect_handler(fn).accepts == {"ut.sub.alpha": Alpha, "ut.sub.beta": Beta}


def test_envelope_annotation_takes_raw_messages() -> None:
    sig = inspect_handler(by_envelope)
    assert sig.accepts is None
    assert sig.takes_context is True


def test_event_base_annotation_takes_any_registered_type() -> None:
    sig = inspect_handler(by_any_event)
    assert sig.any_event is True
    assert sig.accepts == {}


async def no_params() -> None: ...


async def three_params(event: Alpha, ctx: Context, extra: int) -> None: ...


async def unannotated(event, ctx):  # type: ignore[no-untyped-def]
    ...


async def builtin_annotation(event: dict) -> None: ...


async def optional_annotation(event: Alpha | None) -> None: ...


async def unresolvable(event: "NoSuchEvent") -> None: ...  # type: ignore[name-defined]  # noqa: F821


async def two_versions(event: Alpha | AlphaV2) -> None: ...


async def abstract_base(event: "_Base") -> None: ...


class _Base(Event):
    """Not a concrete event type (no type=)."""


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (no_params, "positional parameters"),
        (three_params, "positional parameters"),
        (unannotated, "annotate the first parameter"),
        (builtin_annotation, "annotate the first parameter"),
        (optional_annotation, "annotate the first parameter"),
        (unresolvable, "cannot resolve the annotations"),
        (two_versions, "two versions"),
        (abstract_base, "annotate the first parameter"),
    ],
)
def test_bad_signatures_raise(fn: typing.Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        inspect_handler(fn)
    # The App reports them when it is built, naming the handler.
    marked = subscribe("ut.sub.alpha", group=f"g-{fn.__name__}")(fn)
    with pytest.raises(ConfigurationError, match=fn.__name__):
        App("ut-sub-bad", handlers=[marked])


# -- a handler's types must be reachable through its pattern ---------------------------------


class Gamma(Event, type="ut.other.gamma"):
    g: int


def takes_gamma() -> typing.Any:
    async def handler(event: Gamma) -> None: ...

    return handler


def takes_alpha_or_gamma() -> typing.Any:
    async def handler(event: Alpha | Gamma, ctx: Context) -> None: ...

    return handler


def takes_envelope() -> typing.Any:
    async def handler(env: Envelope) -> None: ...

    return handler


def takes_any_event() -> typing.Any:
    async def handler(event: Event) -> None: ...

    return handler


@pytest.mark.parametrize(
    ("pattern", "make", "unreachable"),
    [
        ("ut.sub.alpha", takes_gamma, "Gamma"),
        ("ut.sub.*", takes_gamma, "Gamma"),
        ("ut.sub.>", takes_alpha_or_gamma, "Gamma"),
        ("ut.other.gamma", takes_alpha_or_gamma, "Alpha"),
        ("ut.*", takes_gamma, "Gamma"),  # '*' is one token: never ut.other.gamma
    ],
)
def test_handler_typed_for_an_event_its_pattern_never_matches_is_refused(
    pattern: str, make: typing.Callable[[], typing.Any], unreachable: str
) -> None:
    fn = make()
    with pytest.raises(ConfigurationError) as info:
        App("ut-sub-unreachable", handlers=[subscribe(pattern)(fn)])
    text = str(info.value)
    assert fn.__qualname__ in text
    assert repr(pattern) in text
    assert unreachable in text
    # It says what to do: fix the pattern, or say so when publishers use topic=...
    assert "Subscribe to a pattern that matches" in text
    assert "topic=" in text
    assert "any_topic=True" in text
    # ... and that escape is honoured: typed events arriving on a custom topic.
    App("ut-sub-any-topic", handlers=[subscribe(pattern, any_topic=True)(make())])


@pytest.mark.parametrize(
    ("pattern", "make"),
    [
        ("ut.other.gamma", takes_gamma),
        ("ut.other.*", takes_gamma),
        ("ut.>", takes_gamma),
        (">", takes_alpha_or_gamma),
        ("ut.*.*", takes_alpha_or_gamma),
        ("ut.sub.alpha", takes_envelope),  # raw envelopes: whatever arrives on the topic
        ("ut.sub.alpha", takes_any_event),  # any registered type: not checked
    ],
)
def test_handler_types_matched_by_the_pattern_are_accepted(
    pattern: str, make: typing.Callable[[], typing.Any]
) -> None:
    app = App("ut-sub-reachable", handlers=[subscribe(pattern, group="g")(make())])
    assert app.groups == ("g",)


def test_stacked_subscriptions_cover_a_union_together() -> None:
    async def handler(event: Alpha | Gamma) -> None: ...

    both = subscribe("ut.sub.alpha", group="a")(subscribe("ut.other.gamma", group="b")(handler))
    assert set(App("ut-sub-stacked", handlers=[both]).groups) == {"a", "b"}

    async def partial(event: Alpha | Gamma | Beta) -> None: ...

    marked = subscribe("ut.sub.alpha", group="a")(subscribe("ut.other.gamma", group="b")(partial))
    with pytest.raises(ConfigurationError, match=r"Beta \(type 'ut.sub.beta'\)"):
        App("ut-sub-stacked-bad", handlers=[marked])


# -- groups and overlapping patterns -----------------------------------------------------------


def _handler(pattern: str, group: str | None) -> typing.Any:
    async def handler(env: Envelope) -> None: ...

    handler.__qualname__ = f"h_{pattern}_{group}"
    return subscribe(pattern, group=group)(handler)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("ut.sub.alpha", "ut.sub.alpha"),
        ("ut.sub.*", "ut.sub.alpha"),
        ("ut.sub.>", "ut.sub.beta"),
        ("ut.*.alpha", "ut.sub.*"),
        (">", "ut.sub.alpha"),
    ],
)
def test_overlapping_patterns_in_one_group_are_rejected(first: str, second: str) -> None:
    a, b = _handler(first, "shared"), _handler(second, "shared")
    with pytest.raises(ConfigurationError) as info:
        App("ut-sub-overlap", handlers=[a, b])
    text = str(info.value)
    assert "'shared'" in text
    assert repr(first) in text and repr(second) in text
    assert "group=" in text


def test_default_group_is_the_app_name_and_overlap_is_checked_there_too() -> None:
    a, b = _handler("ut.sub.*", None), _handler("ut.sub.alpha", None)
    with pytest.raises(ConfigurationError, match="'ut-sub-default'"):
        App("ut-sub-default", handlers=[a, b])


def test_overlapping_patterns_in_different_groups_are_fine() -> None:
    app = App("ut-sub-ok", handlers=[_handler("ut.sub.*", "x"), _handler("ut.sub.alpha", "y")])
    assert app.groups == ("x", "y")


def test_disjoint_patterns_share_a_group() -> None:
    app = App(
        "ut-sub-disjoint",
        handlers=[_handler("ut.sub.alpha", None), _handler("ut.sub.beta", None)],
    )
    assert app.groups == ("ut-sub-disjoint",)


@pytest.mark.parametrize("name", ["", "has space", "tab\there"])
def test_bad_app_names(name: str) -> None:
    with pytest.raises(ConfigurationError, match="app name"):
        App(name)
