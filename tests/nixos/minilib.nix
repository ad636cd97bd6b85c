# A small stand-in for nixpkgs' `lib`, for evaluating tests/nixos/eval-module.nix where
# no nixpkgs is at hand (CI has none; it cannot be downloaded, and its code is never
# committed here). It implements, from scratch, the part of the module system and of
# lib's helpers that nixos/module.nix, the flake's module, the VM test's nodes and the
# eval harness's stubs use, with the semantics nixpkgs documents for them:
#   - evalModules: imports collected once per `key` (breadth first; definitions merged in
#     the reverse of that order, as lib/modules.nix does) (a path's key is the path; a module
#     without one gets "<parent>:anon-<n>"), function modules called with config,
#     options, lib, name and specialArgs; shorthand modules (no options/config) are
#     config; a definition of an undeclared option is an error unless a freeformType
#     takes it;
#   - mkIf, mkMerge, mkOverride (mkDefault 1000, mkForce 50, an option's default 1500,
#     plain definitions 100): the lowest priority number wins, ties are merged; mkIf and
#     mkOverride on an attribute set reach every attribute in it;
#   - types: each one's check and merge as in lib/types.nix (str, bool and int need equal
#     definitions, package and mergeOneOption exactly one, lists concatenate, attrsOf
#     merges per name, nullOr refuses null mixed with non-null, either picks the type all
#     definitions fit, submodule evaluates its definitions as modules).
#   - mkRemovedOptionModule (an assertion naming the option and what replaced it).
# What it does not do: option documentation, mkOrder/mkBefore, mkRenamedOption*,
# disabledModules, _module.args, type merging of twice-declared options. eval-module.sh
# runs the same scenarios with the real lib when NIXPKGS_LIB is given, so the two can be
# compared (they must give the same JSON).
let
  inherit
    (builtins)
    all
    any
    attrNames
    concatLists
    concatStringsSep
    elem
    filter
    foldl'
    genericClosure
    head
    isAttrs
    isBool
    isFloat
    isFunction
    isInt
    isList
    isPath
    isString
    length
    listToAttrs
    mapAttrs
    match
    replaceStrings
    stringLength
    substring
    tail
    ;

  concatMap = f: l: concatLists (map f l);
  last = l: builtins.elemAt l (length l - 1);
  reverseList = l: builtins.genList (i: builtins.elemAt l (length l - 1 - i)) (length l);
  toList = x:
    if isList x
    then x
    else [x];
  optional = c: x:
    if c
    then [x]
    else [];
  optionals = c: l:
    if c
    then l
    else [];
  optionalString = c: s:
    if c
    then s
    else "";
  optionalAttrs = c: a:
    if c
    then a
    else {};
  imap1 = f: l: builtins.genList (i: f (i + 1) (builtins.elemAt l i)) (length l);
  nameValuePair = name: value: {inherit name value;};
  filterAttrs = pred: set: listToAttrs (concatMap (n: optional (pred n set.${n}) (nameValuePair n set.${n})) (attrNames set));
  filterAttrsRecursive = pred: set:
    listToAttrs (concatMap (n: let
      v = set.${n};
    in
      optional (pred n v) (nameValuePair n (
        if isAttrs v
        then filterAttrsRecursive pred v
        else v
      ))) (attrNames set));
  genAttrs = names: f: listToAttrs (map (n: nameValuePair n (f n)) names);
  attrValues = set: map (n: set.${n}) (attrNames set);
  hasPrefix = p: s: substring 0 (stringLength p) s == p;
  hasSuffix = suf: s: let
    ls = stringLength s;
    lf = stringLength suf;
  in
    lf <= ls && substring (ls - lf) lf s == suf;
  hasInfix = infix: s: match ".*${escapeRegex infix}.*" s != null;
  escapeRegex = replaceStrings ["\\" "[" "]" "{" "}" "(" ")" "^" "$" "." "|" "*" "+" "?"] ["\\\\" "\\[" "\\]" "\\{" "\\}" "\\(" "\\)" "\\^" "\\$" "\\." "\\|" "\\*" "\\+" "\\?"];
  removePrefix = p: s:
    if hasPrefix p s
    then substring (stringLength p) (stringLength s - stringLength p) s
    else s;
  remove = e: filter (x: x != e);
  unique = foldl' (acc: x:
    if elem x acc
    then acc
    else acc ++ [x]) [];
  flatten = x:
    if isList x
    then concatMap flatten x
    else [x];
  escapeShellArg = arg: let
    s = toString arg;
  in
    if match "[[:alnum:],._+:@%/-]+" s == null
    then "'${replaceStrings ["'"] ["'\\''"] s}'"
    else s;
  escapeShellArgs = l: concatStringsSep " " (map escapeShellArg l);
  isDerivation = x: isAttrs x && (x.type or null) == "derivation";
  isStringLike = x: isString x || isPath x || (isAttrs x && x ? outPath);
  showOption = concatStringsSep ".";

  # Properties (lib/modules.nix's mkIf, mkMerge, mkOverride).
  mkIf = condition: content: {
    _type = "if";
    inherit condition content;
  };
  mkMerge = contents: {
    _type = "merge";
    inherit contents;
  };
  mkOverride = priority: content: {
    _type = "override";
    inherit priority content;
  };
  mkOptionDefault = mkOverride 1500;
  mkDefault = mkOverride 1000;
  mkForce = mkOverride 50;
  typeOf = v: v._type or null;

  # An attribute set of definitions, with mkIf/mkMerge/mkOverride around it moved onto
  # each attribute: a list of plain attribute sets.
  pushDown = v:
    if typeOf v == "merge"
    then concatMap pushDown v.contents
    else if typeOf v == "if"
    then map (mapAttrs (_: mkIf v.condition)) (pushDown v.content)
    else if typeOf v == "override"
    then map (mapAttrs (_: mkOverride v.priority)) (pushDown v.content)
    else [v];

  # One option's definition with mkIf and mkMerge resolved: a list of values (each maybe
  # under mkOverride).
  discharge = v:
    if typeOf v == "merge"
    then concatMap discharge v.contents
    else if typeOf v == "if"
    then
      (
        if !isBool v.condition
        then throw "mkIf called with a non-Boolean condition"
        else if v.condition
        then discharge v.content
        else []
      )
    else [v];

  # Keeps the definitions of the lowest priority number, without their mkOverride.
  filterOverrides = defs: let
    prio = d:
      if typeOf d.value == "override"
      then d.value.priority
      else 100;
    best =
      foldl' (m: d:
        if prio d < m
        then prio d
        else m)
      9999
      defs;
    strip = d:
      if typeOf d.value == "override"
      then d // {value = d.value.content;}
      else d;
  in
    map strip (filter (d: prio d == best) defs);

  # lib/options.nix's merge helpers.
  mergeEqualOption = loc: defs:
    if defs == []
    then throw "The option `${showOption loc}' has no definitions."
    else
      foldl' (v: d:
        if v == d.value
        then v
        else throw "The option `${showOption loc}' has conflicting definition values: ${builtins.toJSON (map (x: x.value) defs)}.")
      (head defs).value
      defs;
  mergeOneOption = loc: defs:
    if length defs == 1
    then (head defs).value
    else if defs == []
    then throw "The option `${showOption loc}' has no definitions."
    else throw "The option `${showOption loc}' is defined multiple times while it's expected to be unique.";
  mergeDefaultOption = loc: defs: let
    vs = map (d: d.value) defs;
  in
    if length vs == 1
    then head vs
    else if all isList vs
    then concatLists vs
    else if all isAttrs vs
    then foldl' (a: b: a // b) {} vs
    else if all isBool vs
    then any (x: x) vs
    else if all isString vs
    then concatStringsSep "" vs
    else throw "Cannot merge definitions of `${showOption loc}'.";

  mkOptionType = {
    name,
    description ? name,
    check ? (_: true),
    merge ? mergeDefaultOption,
    ...
  } @ t:
    t
    // {
      _type = "option-type";
      inherit name description check merge;
    };

  # Merges one option's (or one attribute's) definitions with type `type`: properties
  # resolved, priorities filtered, every value checked, then the type's merge. Returns
  # { isDefined; value; }.
  mergeDefinitions = loc: type: defs: let
    resolved = filterOverrides (concatMap (d: map (value: d // {inherit value;}) (discharge d.value)) defs);
    checked = map (d:
      if type.check d.value
      then d
      else throw "A definition for option `${showOption loc}' is not of type `${type.description}': ${builtins.toJSON d.value}.")
    resolved;
  in {
    isDefined = resolved != [];
    value = type.merge loc checked;
  };

  types = rec {
    unspecified = mkOptionType {name = "unspecified";};
    bool = mkOptionType {
      name = "bool";
      check = isBool;
      merge = mergeEqualOption;
    };
    int = mkOptionType {
      name = "int";
      check = isInt;
      merge = mergeEqualOption;
    };
    float = mkOptionType {
      name = "float";
      check = isFloat;
      merge = mergeEqualOption;
    };
    str = mkOptionType {
      name = "str";
      check = isString;
      merge = mergeEqualOption;
    };
    singleLineStr = str // {check = x: isString x && match "[^\n\r]*\n?" x != null;};
    nonEmptyStr = str // {check = x: isString x && match "[[:space:]]*" x == null;};
    strMatching = pattern: str // {check = x: isString x && match pattern x != null;};
    lines = mkOptionType {
      name = "lines";
      check = isString;
      merge = _: defs: concatStringsSep "\n" (map (d: d.value) defs);
    };
    path = mkOptionType {
      name = "path";
      check = x: isStringLike x && substring 0 1 (toString x) == "/";
      merge = mergeEqualOption;
    };
    package = mkOptionType {
      name = "package";
      check = x: isDerivation x || (isString x && hasPrefix builtins.storeDir x);
      merge = mergeOneOption;
    };
    attrs = mkOptionType {
      name = "attrs";
      check = isAttrs;
      merge = _: defs: foldl' (a: d: a // d.value) {} defs;
    };
    enum = values:
      mkOptionType {
        name = "enum";
        description = "one of ${concatStringsSep ", " (map builtins.toJSON values)}";
        check = x: elem x values;
        merge = mergeEqualOption;
      };
    ints = let
      between = lo: hi: int // {check = x: isInt x && x >= lo && x <= hi;};
    in {
      inherit between;
      positive = int // {check = x: isInt x && x > 0;};
      unsigned = int // {check = x: isInt x && x >= 0;};
      u16 = between 0 65535;
    };
    port = ints.u16;
    listOf = elemType:
      mkOptionType {
        name = "listOf";
        description = "list of ${elemType.description}";
        check = isList;
        merge = loc: defs:
          concatLists (imap1 (n: d:
            imap1 (m: x: let
              r = mergeDefinitions (loc ++ ["[definition ${toString n}-entry ${toString m}]"]) elemType [(d // {value = x;})];
            in
              r.value)
            d.value)
          defs);
      };
    attrsOf = elemType:
      mkOptionType {
        name = "attrsOf";
        description = "attribute set of ${elemType.description}";
        check = isAttrs;
        merge = loc: defs: let
          pushed = concatMap (d: map (value: d // {inherit value;}) (pushDown d.value)) defs;
          names = unique (concatMap (d: attrNames d.value) pushed);
          merged = map (n: let
            r = mergeDefinitions (loc ++ [n]) elemType (concatMap (d: optional (d.value ? ${n}) (d // {value = d.value.${n};})) pushed);
          in
            nameValuePair n r)
          names;
        in
          mapAttrs (_: r: r.value) (filterAttrs (_: r: r.isDefined) (listToAttrs merged));
      };
    nullOr = elemType:
      mkOptionType {
        name = "nullOr";
        description = "null or ${elemType.description}";
        check = x: x == null || elemType.check x;
        merge = loc: defs: let
          nulls = length (filter (d: d.value == null) defs);
        in
          if nulls == length defs
          then null
          else if nulls != 0
          then throw "The option `${showOption loc}' is defined both null and not null."
          else elemType.merge loc defs;
      };
    either = t1: t2:
      mkOptionType {
        name = "either";
        description = "${t1.description} or ${t2.description}";
        check = x: t1.check x || t2.check x;
        merge = loc: defs:
          if all (d: t1.check d.value) defs
          then t1.merge loc defs
          else if all (d: t2.check d.value) defs
          then t2.merge loc defs
          else mergeOneOption loc defs;
      };
    oneOf = ts: foldl' either (head ts) (tail ts);
    submoduleWith = {modules, ...}:
      mkOptionType {
        name = "submodule";
        check = x: isAttrs x || isFunction x || isPath x;
        merge = loc: defs:
          (evalModules {
            modules =
              modules
              ++ map (d: {
                _file = d.file or "<definition>";
                imports = [d.value];
              })
              defs;
            prefix = loc;
            specialArgs.name = last loc;
          })
          .config;
      };
    submodule = modules: submoduleWith {modules = toList modules;};
    deferredModule = mkOptionType {
      name = "deferredModule";
      check = x: isAttrs x || isFunction x || isPath x;
      merge = _: defs: {imports = map (d: d.value) defs;};
    };
  };

  mkOption = attrs: attrs // {_type = "option";};
  setAttrByPath = path: v:
    if path == []
    then v
    else {${head path} = setAttrByPath (tail path) v;};
  getAttrFromPath = path: set: foldl' (s: n: s.${n}) set path;
  # lib.mkRemovedOptionModule: the option stays declared (hidden), and a definition of it
  # fails an assertion that says what replaced it. nixpkgs' asks `options` whether it is
  # defined and names the defining files; here an unset option keeps a marker default.
  mkRemovedOptionModule = optionName: replacementInstructions: {config, ...}: let
    unset = "<minilib: a removed option, not defined>";
  in {
    options = setAttrByPath optionName (mkOption {
      visible = false;
      default = unset;
    });
    config.assertions = [
      {
        assertion = getAttrFromPath optionName config == unset;
        message = "The option definition `${showOption optionName}' no longer has any effect; please remove it.\n${replacementInstructions}";
      }
    ];
  };
  mkEnableOption = name:
    mkOption {
      type = types.bool;
      default = false;
      description = "Whether to enable ${name}.";
    };
  literalExpression = text: {
    _type = "literalExpression";
    inherit text;
  };

  isOption = v: isAttrs v && (v._type or null) == "option";

  # lib.evalModules, as far as the header says.
  evalModules = {
    modules,
    specialArgs ? {},
    prefix ? [],
  }: let
    args = {inherit lib config options;} // specialArgs;
    # A module as { key; file; options; config; imports; freeformType; }.
    load = parentKey: n: m: let
      file =
        if isPath m
        then toString m
        else parentKey;
      raw =
        if isPath m
        then import m
        else m;
      applied =
        if isFunction raw
        then raw (builtins.intersectAttrs (builtins.functionArgs raw) args // args)
        else raw;
      structured = applied ? options || applied ? config;
    in {
      key =
        if isPath m
        then toString m
        else if applied ? key
        then toString applied.key
        else "${parentKey}:anon-${toString n}";
      file = applied._file or file;
      options = applied.options or {};
      config =
        if structured
        then applied.config or {}
        else removeAttrs applied ["_file" "key" "imports" "meta" "freeformType" "_class" "disabledModules"];
      imports = applied.imports or [];
      freeformType = applied.freeformType or null;
    };
    collected = genericClosure {
      startSet = imap1 (load "") modules;
      operator = m: imap1 (load m.key) m.imports;
    };

    # Every module's option declarations, as one tree.
    mergeDecls = a: b:
      a
      // mapAttrs (n: v:
        if a ? ${n}
        then
          (
            if isOption v || isOption a.${n}
            then throw "The option `${showOption (prefix ++ [n])}' is declared twice."
            else mergeDecls a.${n} v
          )
        else v)
      b;
    decls = foldl' (acc: m: mergeDecls acc m.options) {} collected;

    freeformTypes = filter (t: t != null) (map (m: m.freeformType) collected);
    freeformType =
      if freeformTypes == []
      then null
      else last freeformTypes;

    # Definitions in the reverse of the collected order, as lib/modules.nix merges them.
    defs = map (m: {
      inherit (m) file;
      value = m.config;
    }) (reverseList collected);

    # Walks the declarations and the definitions together: declared options are merged,
    # definitions of undeclared names are collected (for the freeform type) or refused.
    walk = loc: declTree: defsHere: let
      pushed = concatMap (d: map (value: d // {inherit value;}) (pushDown d.value)) defsHere;
      definedNames = unique (concatMap (d: attrNames d.value) pushed);
      defsOf = n: concatMap (d: optional (d.value ? ${n}) (d // {value = d.value.${n};})) pushed;
      declared = mapAttrs (n: decl:
        if isOption decl
        then mergeOption (loc ++ [n]) decl (defsOf n)
        else walk (loc ++ [n]) decl (defsOf n))
      declTree;
      undeclared = filter (n: !(declTree ? ${n})) definedNames;
    in {
      values = mapAttrs (_: r: r.values) declared;
      unmatched =
        concatMap (n:
          map (d: {
            inherit (d) file;
            # From the module's root, for the freeform type.
            value = nest loc {${n} = d.value;};
            path = loc ++ [n];
          }) (defsOf n))
        undeclared
        ++ concatMap (n: declared.${n}.unmatched) (attrNames declared);
    };
    mergeOption = loc: decl: optDefs: let
      type = decl.type or types.unspecified;
      withDefault =
        optDefs
        ++ optional (decl ? default) {
          file = "<default>";
          value = mkOptionDefault decl.default;
        };
      r = mergeDefinitions (prefix ++ loc) type withDefault;
      value =
        if r.isDefined
        then r.value
        else throw "The option `${showOption (prefix ++ loc)}' is used but not defined.";
    in {
      values =
        if decl ? apply
        then decl.apply value
        else value;
      unmatched = [];
    };

    walked = walk [] decls defs;
    # Undeclared definitions, nested back into attribute sets from the root.
    nest = path: v:
      if path == []
      then v
      else {${head path} = nest (tail path) v;};
    freeform =
      if walked.unmatched == []
      then {}
      else if freeformType == null
      then throw "The option `${showOption (prefix ++ (head walked.unmatched).path)}' does not exist. Definition value: ${builtins.toJSON (head walked.unmatched).value}"
      else (mergeDefinitions prefix freeformType walked.unmatched).value;
    config = recursiveUpdateUntilOption freeform walked.values decls;
    options = decls;
  in {
    inherit config options;
  };

  # freeform // declared, merged at the levels where both have attribute sets and the
  # declarations are not options.
  recursiveUpdateUntilOption = a: b: declTree:
    a
    // mapAttrs (n: v:
      if a ? ${n} && isAttrs a.${n} && isAttrs v && !(isOption (declTree.${n} or {}))
      then recursiveUpdateUntilOption a.${n} v (declTree.${n} or {})
      else v)
    b;

  lib = {
    inherit
      all
      any
      attrNames
      attrValues
      concatLists
      concatMap
      concatStringsSep
      elem
      escapeShellArg
      escapeShellArgs
      evalModules
      filter
      filterAttrs
      filterAttrsRecursive
      filterOverrides
      flatten
      genAttrs
      hasInfix
      hasPrefix
      hasSuffix
      head
      imap1
      isDerivation
      last
      literalExpression
      mapAttrs
      mergeDefaultOption
      mergeEqualOption
      mergeOneOption
      mkDefault
      mkEnableOption
      mkForce
      mkIf
      mkMerge
      mkOption
      mkOptionDefault
      mkOptionType
      mkOverride
      mkRemovedOptionModule
      nameValuePair
      optional
      optionalAttrs
      optionalString
      optionals
      remove
      removePrefix
      tail
      toList
      types
      unique
      ;
  };
in
  lib
