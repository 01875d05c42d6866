#!/usr/bin/env bash
# A command-line agent in bash (curl + jq): nothing in it knows asyncrl. `task.agent.type:
# command` starts it once per episode with the episode's OPENAI_BASE_URL / OPENAI_API_KEY and
# the item (ASYNCRL_ITEM, JSON); its last stdout line is its reward. It asks the policy, runs
# the `add` tool when the policy calls it, asks again with the result, and earns 1 when the
# final answer is the item's answer.
set -euo pipefail

prompt=$(jq -r .prompt <<<"$ASYNCRL_ITEM")
answer=$(jq -r .answer <<<"$ASYNCRL_ITEM")
tools='[{"type": "function", "function": {"name": "add", "description": "Add two integers.",
  "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
  "b": {"type": "integer"}}}}}]'
messages=$(jq -n --arg p "$prompt" '[{role: "user", content: $p}]')

ask() {
  jq -n --argjson m "$messages" --argjson t "$tools" \
    '{model: "policy", messages: $m, tools: $t, max_tokens: 64}' |
    curl -sS --fail-with-body -H "Authorization: Bearer $OPENAI_API_KEY" \
      -H "Content-Type: application/json" -d @- "$OPENAI_BASE_URL/chat/completions"
}

for _ in 1 2 3; do
  message=$(ask | jq -c '.choices[0].message')
  messages=$(jq -c --argjson msg "$message" '. + [$msg]' <<<"$messages")
  calls=$(jq -c '.tool_calls // []' <<<"$message")
  [ "$calls" = "[]" ] && break
  while read -r call; do
    sum=$(jq '.function.arguments | fromjson | .a + .b' <<<"$call")
    id=$(jq -r .id <<<"$call")
    messages=$(jq -c --arg id "$id" --arg s "$sum" \
      '. + [{role: "tool", tool_call_id: $id, content: $s}]' <<<"$messages")
  done < <(jq -c '.[]' <<<"$calls")
done

content=$(jq -r '.content // ""' <<<"$message")
if [ "$(echo "$content" | tr -d '[:space:]')" = "$answer" ]; then echo 1; else echo 0; fi
