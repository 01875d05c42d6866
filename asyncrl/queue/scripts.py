"""The queue's server-side transactions (Lua run by EVALSHA), and how `transact` lays out the
arguments of the one every ack and dead letter goes through. Each script checks ownership and
writes in one step: nothing a consumer does with an entry is half applied."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from asyncrl.queue.entries import EntryFields, text

if TYPE_CHECKING:
    from redis.commands.core import Script

# Commit what a consumer did with entries, atomically, if and only if it still owns them.
# KEYS: source stream, counters hash, groups hash, then one stream per entry to add.
# ARGV: group, consumer, n_ids, n_counters, n_adds, n_ends, ended, other, ids...,
#       (field, increment)..., then per added entry: n_pairs, (name, value)...,
#       then per group to end: (group, entry id)...
# Returns {1, added ids...} when applied, {0} if an id is no longer pending (already acked),
# {-1} if another consumer owns it now. Adds come first: the first write is the only one Redis
# may refuse for memory, so a full Redis rejects the whole transaction and leaves nothing
# half-written, while a plain ack (whose XACK is never refused) still frees memory. A group to
# end leaves the groups hash if it is unclaimed or claimed by that entry; the counter `ended`
# counts those, `other` the rest ("" counts nothing): so a dead letter frees admission budget
# only where it ends a released group.
TRANSACT_LUA = """
local stream, counters, groups = KEYS[1], KEYS[2], KEYS[3]
local group, consumer = ARGV[1], ARGV[2]
local n_ids, n_counters, n_adds = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local n_ends, ended, other = tonumber(ARGV[6]), ARGV[7], ARGV[8]
for i = 9, 8 + n_ids do
  local id = ARGV[i]
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 0 then
    if #redis.call('XPENDING', stream, group, id, id, 1) == 0 then return {0} end
    return {-1}
  end
end
local reply = {1}
local a = 9 + n_ids + 2 * n_counters
for k = 1, n_adds do
  local n = tonumber(ARGV[a])
  reply[k + 1] = redis.call('XADD', KEYS[3 + k], '*', unpack(ARGV, a + 1, a + 2 * n))
  a = a + 1 + 2 * n
end
for i = 9, 8 + n_ids, 1000 do
  redis.call('XACK', stream, group, unpack(ARGV, i, math.min(i + 999, 8 + n_ids)))
end
for c = 9 + n_ids, 8 + n_ids + 2 * n_counters, 2 do
  redis.call('HINCRBY', counters, ARGV[c], ARGV[c + 1])
end
local n_ended = 0
for e = a, a + 2 * n_ends - 1, 2 do
  local owner = redis.call('HGET', groups, ARGV[e])
  if owner == '' or owner == ARGV[e + 1] then
    redis.call('HDEL', groups, ARGV[e])
    n_ended = n_ended + 1
  end
end
if ended ~= '' and n_ended > 0 then redis.call('HINCRBY', counters, ended, n_ended) end
if other ~= '' and n_ends > n_ended then
  redis.call('HINCRBY', counters, other, n_ends - n_ended)
end
return reply
"""

# Whether delivered entries may be worked on. KEYS: groups hash. ARGV: claim ("1" or "0"), then
# (group, entry id) pairs. Per pair: "" when the group is open and unclaimed or claimed by that
# entry (a redelivery), "unreleased" when it is not open (never opened, or ended), "duplicate"
# when another entry claimed it. With claim "1" an unclaimed group is claimed for its entry.
ADMIT_LUA = """
local out = {}
for i = 2, #ARGV, 2 do
  local owner = redis.call('HGET', KEYS[1], ARGV[i])
  if not owner then
    out[#out + 1] = 'unreleased'
  elseif owner == ARGV[i + 1] then
    out[#out + 1] = ''
  elseif owner ~= '' then
    out[#out + 1] = 'duplicate'
  else
    if ARGV[1] == '1' then
      -- HDEL first: Redis never refuses it for memory, and a script that has written is let
      -- write on, so a full Redis does not stall the reader whose acks would free it.
      redis.call('HDEL', KEYS[1], ARGV[i])
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    out[#out + 1] = ''
  end
end
return out
"""

# Settle entries one by one with an outcome. KEYS: stream, counters, groups hash. ARGV: group,
# consumer, outcome counter, n_ids, ids..., then (group, entry id) pairs. An id pending on this
# consumer is acked, counted and ends its group; one the stream no longer has at all (neither
# entry nor pending: Redis lost its data since it was read) is counted and ends its group only
# where that group names it (admission opened it again for its holder when it found the loss);
# any other (acked already, or taken over) is left. pcall: after a loss the group may not exist
# yet, and every id is then gone. Returns the number counted.
SETTLE_LUA = """
local stream, counters, groups = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, outcome = ARGV[1], ARGV[2], ARGV[3]
local n = tonumber(ARGV[4])
local group_of = {}
for e = 5 + n, #ARGV, 2 do group_of[ARGV[e + 1]] = ARGV[e] end
local counted = 0
for i = 5, 4 + n do
  local id = ARGV[i]
  local g = group_of[id]
  local own = redis.pcall('XPENDING', stream, group, id, id, 1, consumer)
  if type(own) == 'table' and #own == 1 then
    redis.call('XACK', stream, group, id)
    counted = counted + 1
    if g and redis.call('HGET', groups, g) == '' then redis.call('HDEL', groups, g) end
  elseif g and #redis.call('XRANGE', stream, id, id) == 0 then
    local any = redis.pcall('XPENDING', stream, group, id, id, 1)
    if (type(any) ~= 'table' or #any == 0) and redis.call('HGET', groups, g) == id then
      counted = counted + 1
    end
  end
  if g and redis.call('HGET', groups, g) == id then redis.call('HDEL', groups, g) end
end
if counted > 0 then redis.call('HINCRBY', counters, outcome, counted) end
return counted
"""


# Add entries that each open a group, counted, with a state hash written beside them, while the
# counter still reads what the caller read. KEYS: stream, counters hash, groups hash, state hash.
# ARGV: counter, expected count, n_entries, n_state, (name, value) of the state..., then per
# entry: n_pairs, (name, value).... Returns 1 when applied, 0 if the counter had moved (a retry
# whose first attempt was applied, or a Redis that lost the counter). An XADD is the first write,
# the only one Redis may refuse for memory: a full Redis rejects the whole transaction.
ADD_COUNTED_LUA = """
local counters, counter = KEYS[2], ARGV[1]
if tonumber(redis.call('HGET', counters, counter) or 0) ~= tonumber(ARGV[2]) then return 0 end
local n, n_state = tonumber(ARGV[3]), tonumber(ARGV[4])
local a = 5 + 2 * n_state
for k = 1, n do
  local m = tonumber(ARGV[a])
  local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, a + 1, a + 2 * m))
  redis.call('HSET', KEYS[3], id, '')
  a = a + 1 + 2 * m
end
redis.call('HINCRBY', counters, counter, n)
if n_state > 0 then redis.call('HSET', KEYS[4], unpack(ARGV, 5, 4 + 2 * n_state)) end
return 1
"""


def transact(
    script: Script,
    *,
    stream: str,
    group: str = "",
    consumer: str = "",
    ids: list[str],
    counters_key: str | None,
    counters: Mapping[str, int],
    adds: list[tuple[str, EntryFields]],
    groups_key: str | None = None,
    ends: list[tuple[str, str]] | None = None,
    end_counters: tuple[str, str] = ("", ""),
) -> tuple[int, list[str]]:
    """Run `TRANSACT_LUA` (`script`, registered on the client) on these arguments: its status
    and the ids of the entries it added."""
    ends = ends or []
    keys = [stream, counters_key or stream, groups_key or stream, *(s for s, _ in adds)]
    args: list[Any] = [group, consumer, len(ids), len(counters), len(adds), len(ends)]
    args += [*end_counters, *ids]
    for name, increment in counters.items():
        args += [name, int(increment)]
    for _, fields in adds:
        args.append(len(fields))
        for k, v in fields.items():
            args += [k, v]
    for group_field, owner in ends:
        args += [group_field, owner]
    reply = script(keys=keys, args=args)
    return int(reply[0]), [text(x) for x in reply[1:]]
