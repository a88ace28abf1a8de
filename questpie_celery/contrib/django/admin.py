"""A read-only Django admin for the ledger: dispatches, schedules and queue policies.

Nothing here adds, changes or deletes a row: the permissions to do so are refused to
everyone, superusers included, so the pages only list and show, and a POST gets a 403.
The models map no payload and no ciphertext (see `models.py`), so no page can show one.

Every page stays quick on a ledger of millions of dispatches:

- no `COUNT(*)` of the table: the paginator counts at most `COUNT_CAP` rows, and beyond
  that shows PostgreSQL's planner estimate (or "more than"); pages go as deep as
  `COUNT_CAP` rows, since an OFFSET further down costs what it skips;
- the list reads newest first, the order of the ledger's `(created_at, id)` index (and
  `(job_name, created_at)` once filtered by job); columns do not re-sort the list;
- the job filter's choices come from a skip scan of the `(job_name, created_at)` index,
  one probe per job, not a `SELECT DISTINCT` of every row; the status filter's are the
  ledger's vocabulary; no facet counts, no date hierarchy;
- the search takes an exact dispatch id or idempotency key: a key is turned into the id
  it derives under each job, so the lookup is by primary key, never a LIKE.
"""

from __future__ import annotations

import math
from typing import Any, get_args

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import URLPattern, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html

from ...jobs.ids import derive_dispatch_id, unstorable_id
from ...ledger.schema import Status
from ...ledger.views import distinct_job_names, planned_rows
from .models import Dispatch, Policy, Schedule
from .settings import ledger_database

#: The paginator counts this many rows at most, and pages reach this deep at most.
COUNT_CAP = 10_000
#: The job filter lists this many jobs at most (a skip scan probes the index once each).
MAX_JOBS = 500
STATUSES: tuple[str, ...] = get_args(Status)


def job_names(using: str, limit: int = MAX_JOBS) -> list[str]:
    """The distinct job names in the ledger, sorted (a skip scan: see
    `ledger.views.distinct_job_names`)."""
    connection = connections[using]
    return distinct_job_names(connection.cursor, connection.ops.quote_name, limit)


def planner_estimate(queryset: QuerySet[Any]) -> int | None:
    """How many rows PostgreSQL's planner expects `queryset` to return (its statistics,
    not a count); None on other databases."""
    connection = connections[queryset.db]
    sql, params = queryset.order_by().query.sql_with_params()
    return planned_rows(connection.cursor, connection.vendor, sql, params)


class LedgerPaginator(Paginator):
    """Counts at most `COUNT_CAP` rows (exact below that), estimates beyond, and pages
    through the first `COUNT_CAP` rows only."""

    cap = COUNT_CAP

    @cached_property
    def count(self) -> int:
        queryset: QuerySet[Any] = self.object_list
        counted = int(queryset.order_by()[: self.cap + 1].count())
        self.exact = counted <= self.cap
        if self.exact:
            return counted
        estimate = planner_estimate(queryset)
        self.estimated = estimate is not None
        return max(estimate or 0, counted)

    @cached_property
    def num_pages(self) -> int:
        count: int = self.count
        if count == 0 and not self.allow_empty_first_page:
            return 0
        hits = max(1, min(count, self.cap) - int(self.orphans))
        return math.ceil(hits / int(self.per_page))

    exact = True
    estimated = False

    def describe(self, singular: str, plural: str) -> str:
        """The count as the page words it: exact, estimated, or a lower bound."""
        count = self.count
        if self.exact:
            return f"{count:,} {singular if count == 1 else plural}"
        shown = f"about {count:,}" if self.estimated else f"more than {self.cap:,}"
        return f"{shown} {plural}; the newest {self.cap:,} are paged, filter or search for others"


class LedgerChangeList(ChangeList):
    """Django's change list, plus the page links and the count text the template shows,
    always in the model's order: an `?o=` in the URL would sort the whole table."""

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[str]:
        return [*self.lookup_opts.ordering]

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        paginator: LedgerPaginator = self.paginator
        self.page_links = (
            list(paginator.get_elided_page_range(self.page_num)) if self.multi_page else []
        )
        self.count_text = paginator.describe(
            str(self.opts.verbose_name), str(self.opts.verbose_name_plural)
        )


class JobFilter(admin.SimpleListFilter):
    title = "job"
    parameter_name = "job"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in job_names(ledger_database())]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(job_name=value) if value else queryset


class StatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(status, status) for status in STATUSES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(status=value) if value else queryset


class ReadOnlyAdmin(admin.ModelAdmin):
    """Lists and shows, for whoever may view the model; nobody adds, changes or deletes."""

    actions = None
    show_facets = admin.ShowFacets.NEVER
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # The ledger's database (QUESTPIE_DATABASE), whatever the project's routers say.
        return super().get_queryset(request).using(ledger_database())

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ListOnlyAdmin(ReadOnlyAdmin):
    """A small table whose list shows every column: no page per row."""

    list_display_links = None

    def get_urls(self) -> list[URLPattern]:
        return [url for url in super().get_urls() if str(url.name).endswith("_changelist")]


@admin.register(Dispatch)
class DispatchAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "job_name",
        "idempotency_key",
        "status",
        "attempt",
        "created_at",
        "queued_at",
        "started_at",
        "finished_at",
        "last_error",
    )
    list_filter = (JobFilter, StatusFilter)
    # Searched by `get_search_results`, exactly; declared so the search box shows.
    search_fields = ("=id",)
    search_help_text = "An exact dispatch id, or an exact idempotency key."
    sortable_by = ()
    paginator = LedgerPaginator
    list_per_page = 100
    change_list_template = "questpie_celery/admin/change_list.html"
    fieldsets = (
        (None, {"fields": ("id", "job_name", "idempotency_key", "status", "attempt")}),
        ("Last error", {"fields": ("last_error",)}),
        (
            "Times",
            {
                "fields": (
                    "created_at",
                    "queued_at",
                    "started_at",
                    "finished_at",
                    "run_after",
                    "next_send_at",
                    "lease_expires_at",
                    "cancel_requested_at",
                    "send_count",
                )
            },
        ),
        ("Queue policy", {"fields": ("policy", "singleton_key", "slot", "debounce_key")}),
        ("Limits", {"fields": ("group_key", "seat", "waiting_for")}),
        ("Secret payload", {"fields": ("secret", "secret_key_id")}),
    )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return LedgerChangeList

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Any:
        # An id no row can have (a NUL, which PostgreSQL text cannot hold) is answered as
        # an unknown one, not with the database's error.
        if from_field is None and unstorable_id(object_id) is not None:
            return None
        return super().get_object(request, object_id, from_field)

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Only the two filters' own parameters: a hand-written `?last_error__icontains=`
        # or `__regex` would scan the table; Django answers such a URL with an error.
        return lookup in (JobFilter.parameter_name, StatusFilter.parameter_name)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        # As typed too: a plain call's task id (or a key) may begin or end with a blank.
        terms = {term, search_term}
        ids = terms | {derive_dispatch_id(job, t) for job in job_names(queryset.db) for t in terms}
        return queryset.filter(pk__in=sorted(ids)), False


@admin.register(Schedule)
class ScheduleAdmin(ListOnlyAdmin):
    list_display = (
        "job_name",
        "source",
        "cron",
        "tz",
        "singleton_key",
        "next_fire_at",
        "last_fire_at",
        "last_dispatch",
        "updated_at",
    )

    @admin.display(description="last dispatch")
    def last_dispatch(self, schedule: Schedule) -> str:
        if schedule.last_dispatch_id is None:
            return "-"
        opts = Dispatch._meta
        url = reverse(
            f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_change",
            args=[schedule.last_dispatch_id],
        )
        link: str = format_html('<a href="{}">{}</a>', url, schedule.last_dispatch_id)
        return link


@admin.register(Policy)
class PolicyAdmin(ListOnlyAdmin):
    list_display = ("job_name", "policy", "updated_at")
