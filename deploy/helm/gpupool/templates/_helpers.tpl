{{/*
The DRA driver's name. It is also the DeviceClass's name, the attribute and capacity domain of
the published devices, and the resourceNames of the resourceclaims/driver rule. The binaries
publish under this name: it is not a value.
*/}}
{{- define "gpupool.driverName" -}}
gpu.gpupool.dev
{{- end }}

{{- define "gpupool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object's name. Kept to 40 characters so that "<prefix>-broker-headless" and
the brokers' pod names ("<prefix>-broker-N", a DNS label) stay within 63.
*/}}
{{- define "gpupool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpupool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object. Call with (dict "ctx" $ "component" "broker").
*/}}
{{- define "gpupool.labels" -}}
helm.sh/chart: {{ include "gpupool.chart" .ctx }}
{{ include "gpupool.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: gpupool
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "ctx" $ "component" "broker").
*/}}
{{- define "gpupool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpupool.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{- define "gpupool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "gpupool.broker.name" -}}
{{- printf "%s-broker" (include "gpupool.fullname" .) }}
{{- end }}

{{- define "gpupool.broker.headless" -}}
{{- printf "%s-broker-headless" (include "gpupool.fullname" .) }}
{{- end }}

{{/*
The brokers' gRPC addresses, comma-separated: the stable DNS name of every server of the
StatefulSet, or broker.externalAddresses. Every component gets this list.
*/}}
{{- define "gpupool.brokerAddrs" -}}
{{- if .Values.broker.enabled }}
{{- $name := include "gpupool.broker.name" . }}
{{- $svc := include "gpupool.broker.headless" . }}
{{- $addrs := list }}
{{- range $i := until (int .Values.broker.replicas) }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $name $i $svc $.Release.Namespace $.Values.clusterDomain (int $.Values.broker.ports.grpc)) }}
{{- end }}
{{- join "," $addrs }}
{{- else }}
{{- required "broker.externalAddresses: give the brokers' addresses when broker.enabled is false" (join "," .Values.broker.externalAddresses) }}
{{- end }}
{{- end }}

{{/*
clientNodeSelector as a label selector string (k=v,k=v), for k8s-controller --node-selector.
*/}}
{{- define "gpupool.clientNodeSelector" -}}
{{- $terms := list }}
{{- range $k, $v := .Values.clientNodeSelector }}
{{- $terms = append $terms (printf "%s=%s" $k $v) }}
{{- end }}
{{- required "clientNodeSelector: give at least one node label; pools reachable from every node are not supported" (join "," $terms) }}
{{- end }}

{{- define "gpupool.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create }}
{{- default (printf "%s-controller" (include "gpupool.fullname" .)) .Values.controller.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controller.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpupool.nodePlugin.serviceAccountName" -}}
{{- if .Values.nodePlugin.serviceAccount.create }}
{{- default (printf "%s-node-plugin" (include "gpupool.fullname" .)) .Values.nodePlugin.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.nodePlugin.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Pod anti-affinity among the pods of one component. Call with
(dict "ctx" $ "component" "broker" "mode" "soft").
*/}}
{{- define "gpupool.podAntiAffinity" -}}
{{- if eq .mode "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "gpupool.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 10 }}
{{- else if eq .mode "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "gpupool.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 12 }}
{{- else if ne .mode "" }}
{{- fail (printf "podAntiAffinity %q: must be soft, hard or empty" .mode) }}
{{- end }}
{{- end }}

{{/*
The environment every gpupool container gets: GPUPOOL_ADDR lets `kubectl exec POD -- gpupool
status` reach the brokers without flags.
*/}}
{{- define "gpupool.commonEnv" -}}
- name: GPUPOOL_ADDR
  value: {{ include "gpupool.brokerAddrs" . | quote }}
{{- include "gpupool.tls.env" . | nindent 0 }}
{{- end }}

{{/*
The TLS Secret of a component (broker, agent or client), by its value or the default name.
*/}}
{{- define "gpupool.tls.secret" -}}
{{- $ctx := .ctx }}
{{- default (printf "%s-%s-tls" (include "gpupool.fullname" $ctx) .component) (get $ctx.Values.tls (printf "%sSecret" .component)) }}
{{- end }}

{{/*
TLS environment (GPUPOOL_TLS_*) of every container that talks to the brokers; empty without TLS.
*/}}
{{- define "gpupool.tls.env" -}}
{{- if .Values.tls.enabled }}
- name: GPUPOOL_TLS_CA
  value: /etc/gpupool/tls/ca.crt
- name: GPUPOOL_TLS_CERT
  value: /etc/gpupool/tls/tls.crt
- name: GPUPOOL_TLS_KEY
  value: /etc/gpupool/tls/tls.key
{{- end }}
{{- end }}

{{- define "gpupool.tls.volumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/gpupool/tls
  readOnly: true
{{- end }}
{{- end }}

{{/*
The TLS Secret volume of a component: dict "ctx" $ "component" broker|agent|client.
*/}}
{{- define "gpupool.tls.volume" -}}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "gpupool.tls.secret" . }}
{{- end }}
{{- end }}

{{/*
The Secrets that hold the ACL tokens (acl.tokensSecret, acl.agentTokensSecret).
*/}}
{{- define "gpupool.tokensSecret" -}}
{{- default (printf "%s-tokens" (include "gpupool.fullname" .)) .Values.acl.tokensSecret }}
{{- end }}

{{- define "gpupool.agentTokensSecret" -}}
{{- default (printf "%s-agent-tokens" (include "gpupool.fullname" .)) .Values.acl.agentTokensSecret }}
{{- end }}

{{/*
The names the brokers' TLS certificate carries: every name clients dial them at (each server's
stable DNS name, by a wildcard of the headless Service, and the client Service), or the hosts of
broker.externalAddresses.
*/}}
{{- define "gpupool.brokerTLSHosts" -}}
{{- $ns := .Release.Namespace }}
{{- $hosts := list }}
{{- if .Values.broker.enabled }}
{{- $hosts = append $hosts (printf "*.%s.%s.svc.%s" (include "gpupool.broker.headless" .) $ns .Values.clusterDomain) }}
{{- $hosts = append $hosts (printf "%s.%s.svc" (include "gpupool.broker.name" .) $ns) }}
{{- $hosts = append $hosts (printf "%s.%s.svc.%s" (include "gpupool.broker.name" .) $ns .Values.clusterDomain) }}
{{- else }}
{{- range .Values.broker.externalAddresses }}
{{- $hosts = append $hosts (regexReplaceAll ":[0-9]+$" . "") }}
{{- end }}
{{- end }}
{{- join "," $hosts }}
{{- end }}

{{/*
The CEL expression of one deviceClass.extra[].match entry: its attribute (checked against the
published ones by values.schema.json), read with a default so that a device without it does not
fail the allocation, compared by the entry's one operator.
*/}}
{{- define "gpupool.matchCEL" -}}
{{- $m := .match }}
{{- $domain := .driver }}
{{- $name := $m.attribute }}
{{- if eq $m.attribute "pcieRoot" }}{{ $domain = "resource.kubernetes.io" }}{{ end }}
{{- $default := "\"\"" }}
{{- if eq $m.attribute "index" }}{{ $default = "-1" }}{{ end }}
{{- if eq $m.attribute "mps" }}{{ $default = "false" }}{{ end }}
{{- $read := printf "device.attributes[%q].?%s.orValue(%s)" $domain $name $default }}
{{- if hasKey $m "equals" }}
{{- printf "%s == %s" $read (toJson $m.equals) }}
{{- else if hasKey $m "in" }}
{{- printf "%s in %s" $read (toJson $m.in) }}
{{- else if hasKey $m "startsWith" }}
{{- printf "%s.startsWith(%s)" $read (toJson $m.startsWith) }}
{{- else if hasKey $m "endsWith" }}
{{- printf "%s.endsWith(%s)" $read (toJson $m.endsWith) }}
{{- end }}
{{- end }}
